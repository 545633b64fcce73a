"""The README's Quick start commands are the ones that run: each `make` target it names is in the Makefile,
and CI (.ci/run) runs its test command."""

import re

from conftest import REPO


def quick_start_commands() -> list[str]:
    """Lines of the first ```bash block under the README heading that starts with "## Quick start"."""
    readme = (REPO / "README.md").read_text()
    section = re.search(r"^## Quick start.*?$(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, "README.md has no section whose heading starts with '## Quick start'"
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "README.md's Quick start section has no ```bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w./$()-]+)\s*:(?!=)", text, re.M))


def test_quick_start_make_targets_exist():
    targets = [m for line in quick_start_commands() for m in re.findall(r"\bmake\s+([\w.-]+)", line)]
    assert "test" in targets, f"the Quick start block runs no `make test` (its make targets: {targets})"
    missing = [t for t in targets if t not in makefile_targets()]
    assert not missing, f"README Quick start names make targets the Makefile lacks: {missing}"


def test_ci_runs_the_readme_test_command():
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "make test" in lines, ".ci/run does not run `make test`, the README's test command"
