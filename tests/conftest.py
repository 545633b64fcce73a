"""Shared fixtures: the tiny artifacts (built once per session) and a real torchrun launcher."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
# The suite starts some 300 Python processes on the repository's modules: compile them once, whatever the
# environment says (tests' subprocesses inherit this).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


# `make test` runs two files at a time (xdist, --dist loadfile), handing out whole files in collection order
# (--no-loadscope-reorder): the longest ones go first, so that none starts last while the other worker idles.
# In order of their tests' summed durations in CI on a Zen 3 (fp32 there): 10 minutes of a worker for the
# SmolLM2 file down to 2 for test_ckpt_integrity.py; every other file under 2.
LONGEST_FILES_FIRST = ["test_smollm2.py", "test_games.py", "test_grpo_e2e.py", "test_agentic.py", "test_bench.py",
                       "test_sft.py", "test_pipelines.py", "test_fault_tolerance.py", "test_qwen3.py", "test_slurm.py",
                       "test_hostile.py", "test_ckpt_integrity.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: a file's tests keep their order


def script_command(script: str, args: list[str], nproc: int | None = None, launcher_args: tuple[str, ...] = ()
                   ) -> list[str]:
    """How a user runs a repo script: under `torchrun --standalone` when nproc is given, else plain python."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *launcher_args] if nproc else [sys.executable]
    return [*launcher, str(REPO / script), *args]


def script_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def no_vllm_on_ranks(*ranks: int) -> dict[str, str]:
    """Environment under which importing vLLM fails on these torchrun ranks (tests/fixtures/no_vllm)."""
    return {"PYTHONPATH": f"{REPO / 'tests' / 'fixtures' / 'no_vllm'}:{REPO}",
            "FORGE_TEST_NO_VLLM_RANKS": ",".join(map(str, ranks))}


def run_script(script: str, args: list[str], nproc: int | None = None, check: bool = True,
               timeout: int = 600, stdin: str | None = None, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    proc = subprocess.run(script_command(script, args, nproc), cwd=REPO, env={**script_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start in a session of its own (output to `log`), so that `stop` takes torchrun's workers down with it."""
    return subprocess.Popen(command, cwd=REPO, env=env or script_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def assert_clean_error(proc: subprocess.CompletedProcess, script: str, *fragments: str) -> None:
    """A user mistake: non-zero exit, our one-line message, and no traceback through our own code
    (torchrun still prints its own failure summary after it)."""
    assert proc.returncode != 0
    assert all(f in proc.stderr for f in fragments), proc.stderr[-3000:]
    assert f'File "{REPO / script}"' not in proc.stderr, proc.stderr[-3000:]


def read_metrics(out_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: metrics}; a step logged twice (a resumed run) keeps its last entry."""
    by_step = {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = row
    return by_step


def built_once(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """A session artifact that `build(out)` writes once for all xdist workers of this run: the first worker
    to need it builds it, another one waits for it (each would otherwise build its own: a GRPO run, once per
    worker)."""
    if worker_id == "master":                       # no xdist
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    out = tmp_path_factory.getbasetemp().parent / name     # this run's directory, shared by its workers
    with FileLock(f"{out}.lock"):
        if not (out / ".built").is_file():
            shutil.rmtree(out, ignore_errors=True)    # a build that failed half-way
            out.mkdir()
            build(out)
            (out / ".built").touch()
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, worker_id) -> Path:
    """artifacts of tools/build_tiny.py: init/ (model + tokenizer), data/{train,eval}.jsonl."""
    return built_once(tmp_path_factory, worker_id, "tiny", lambda out: subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_tiny.py"), "--out", str(out)], check=True, cwd=REPO,
        capture_output=True))


def assert_same_curve(run: dict[int, dict], straight: dict[int, dict], steps: range,
                      keys: tuple[str, ...] = ("reward/mean", "loss/entropy", "train/grad_norm"),
                      rel: float = 1e-5) -> None:
    """A resumed (or restarted) GRPO run logged the straight run's numbers at every step in `steps`."""
    for step in steps:
        for key in keys:
            assert run[step][key] == pytest.approx(straight[step][key], rel=rel, abs=1e-7), (step, key)


def tiny_sft_args(tiny: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--config", "configs/sft/tiny.yaml", "--model.path", str(tiny / "init"),
            "--data.path", str(tiny / "data" / "train.jsonl"), "--data.eval_path", str(tiny / "data" / "eval.jsonl"),
            "--out_dir", str(out_dir), *extra]


STEPS = 12


def grpo_args(tiny, out_dir, *extra: str) -> list[str]:
    return ["--config", "configs/grpo/tiny.yaml", "--model.path", str(tiny / "init"),
            "--data.path", str(tiny / "data" / "train.jsonl"), "--data.eval_path", str(tiny / "data" / "eval.jsonl"),
            "--data.eval_rows", "16", "--train.eval_every", "0", "--out_dir", str(out_dir),
            "--rewards.functions", "tests/rewards_for_tests.py:digit_fraction", "--optim.lr", "3e-3",
            "--train.prompts_per_step", "8", "--sampling.max_tokens", "6", *extra]


@pytest.fixture(scope="session")
def three_role_run(tiny, tmp_path_factory, worker_id) -> Path:
    """The straight 12-step GRPO run (3 ranks, checkpoints at steps 6 and 12) that other runs are compared with.
    Its reference and reward ranks cannot import vLLM (they join the engine's groups without it)."""
    def run(out: Path) -> None:
        proc = run_script("train_grpo.py", grpo_args(tiny, out, "--train.steps", str(STEPS), "--ckpt.save_every", "6"),
                          nproc=3, env=no_vllm_on_ranks(1, 2))
        (out / "console.log").write_text(proc.stdout)
    return built_once(tmp_path_factory, worker_id, "grpo_three_roles", run)


FOUR_RANK_STEPS = 4
FOUR_RANK_ARGS = ("--train.steps", str(FOUR_RANK_STEPS), "--loss.beta", "0.1", "--layout.reference", "2")


@pytest.fixture(scope="session")
def four_rank_run(tiny, tmp_path_factory, worker_id) -> Path:
    """A 4-rank GRPO run on one node: policy | 2 reference ranks (FSDP) | reward, with a KL term."""
    return built_once(tmp_path_factory, worker_id, "grpo_four_ranks", lambda out: run_script(
        "train_grpo.py", grpo_args(tiny, out, *FOUR_RANK_ARGS), nproc=4))


HELD_OUT_ACCURACY = re.compile(r"held-out accuracy: greedy ([\d.]+) -> ([\d.]+) \(\d+ rows, s.e. [\d.]+\), "
                               r"sampled \(T=1, 8 per prompt\) ([\d.]+) -> ([\d.]+) \(step 0 -> (\d+)\)")


def trained_sft(out: Path, task: str, sft_config: str, sft_steps: int, *extra: str) -> Path:
    """build_tiny.py's task in `out/artifacts`, SFT on 2 ranks into `out/sft` (its HF export: `out/sft/hf`);
    `extra`: more overrides."""
    data = out / "artifacts"
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--task", task, "--out", str(data)],
                   check=True, cwd=REPO, capture_output=True)
    run_script("train_sft.py", ["--config", sft_config, "--model.path", str(data / "init"), *_data_paths(data),
                                "--train.steps", str(sft_steps), "--train.eval_every", "0", "--data.eval_rows", "16",
                                "--out_dir", str(out / "sft"), *extra], nproc=2, timeout=1800)  # Zen 1, 2 tests at once
    return out


def _data_paths(data: Path) -> list[str]:
    return ["--data.path", str(data / "data" / "train.jsonl"), "--data.eval_path", str(data / "data" / "eval.jsonl")]


@pytest.fixture(scope="session")
def addition_sft(tmp_path_factory, worker_id) -> Path:
    """The default pipeline's SFT (`make run`'s first half), shortened to 500 steps (not 700) of its 128 rows,
    shared by the GRPO runs that start from it (full and LoRA). Steps of 64 rows left it at exact match 0.19 on a Xeon
    model 167 (0.5 and more on a Zen 3), where GRPO then lifted greedy 0.125 -> 0.19 only."""
    return built_once(tmp_path_factory, worker_id, "addition_sft",
                      lambda out: trained_sft(out, "addition", "configs/sft/tiny.yaml", 500))


def grpo_after_sft(sft: Path, out: Path, grpo_config: str, grpo_steps: int, *extra: str) -> subprocess.CompletedProcess:
    """GRPO from `trained_sft`'s model on one rank (the policy scores its own samples, as reward ranks would:
    test_grpo_e2e.py::test_reward_ranks_score_like_one_process)."""
    return run_script("train_grpo.py", ["--config", grpo_config, "--model.path", str(sft / "sft" / "hf"),
                                        *_data_paths(sft / "artifacts"), "--train.steps", str(grpo_steps),
                                        "--train.eval_every", "0", "--data.eval_rows", "64", "--out_dir", str(out),
                                        "--layout.reference", "0", "--layout.reward", "0", *extra], nproc=1)


def run_pipeline(tmp_path: Path, task: str, sft_config: str, grpo_config: str, sft_steps: int, grpo_steps: int,
                 *sft_extra: str) -> tuple[dict, subprocess.CompletedProcess]:
    """A shipped pipeline, shortened: SFT (`trained_sft`, with the overrides `sft_extra`), then GRPO
    (`grpo_after_sft`). The SFT run's metrics and the GRPO run."""
    trained_sft(tmp_path, task, sft_config, sft_steps, *sft_extra)
    return read_metrics(tmp_path / "sft"), grpo_after_sft(tmp_path, tmp_path / "grpo", grpo_config, grpo_steps)
