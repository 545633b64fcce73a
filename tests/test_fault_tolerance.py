"""Never lose a run: `kill -9` at random moments. The seed of each test's moments is printed on failure
(FORGE_KILL_SEED=<seed> replays it)."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (STEPS, assert_same_curve, grpo_args, read_metrics, run_script, script_command, start,
                      stop)

SEED = int(os.environ.get("FORGE_KILL_SEED", time.time_ns() % 100_000))


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert proc.poll() is None, f"exited {proc.returncode} while waiting for {what} (seed {SEED})"
        assert time.monotonic() < deadline, f"timed out waiting for {what} (seed {SEED})"
        time.sleep(0.05)
    return value


def workers(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the live training processes torchrun started."""
    found = {}
    children = [c for task in Path(f"/proc/{agent_pid}/task").iterdir() for c in thread_children(task)]
    for child in children:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in kv)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(child)
    return found


def thread_children(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except FileNotFoundError:            # a thread of the agent that ended since the directory was listed
        return []


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_checkpoint_killed_mid_write_leaves_the_previous_one_loadable(tmp_path):
    """A writer saves 96 MiB checkpoints back to back; kill -9 lands inside a save (DCP shards, RNG, meta,
    rename or pruning) at random moments. Each time, the latest complete checkpoint loads and is consistent."""
    rng = random.Random(SEED)
    mid_write = 0
    for attempt in range(4):
        log = tmp_path / f"writer{attempt}.log"
        proc = start(script_command("tests/ckpt_writer.py", ["write", str(tmp_path / "out")]), log)
        wait_for(lambda: "saved" in log.read_text(), proc, "a first save")
        time.sleep(rng.uniform(0.0, 2.0))
        stop(proc)
        mid_write += any((tmp_path / "out" / "checkpoints").glob("*.tmp"))
        check = run_script("tests/ckpt_writer.py", ["check", str(tmp_path / "out")])
        loaded = json.loads(check.stdout.strip().splitlines()[-1])
        assert loaded["consistent"], (attempt, loaded, f"seed {SEED}")
        assert loaded["step"] >= 1
    assert mid_write > 0, f"no kill landed inside a save (seed {SEED})"


def test_grpo_survives_kill9_of_any_rank(tiny, three_role_run, tmp_path):
    """`torchrun --max-restarts 3`: the policy, reference and reward rank are each killed once, at random
    moments (mid-training, during start-up or resume, right after a step). Every restart resumes from the
    last checkpoint and the run ends with the straight run's metrics at every step."""
    rng = random.Random(SEED)
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    args = grpo_args(tiny, out, "--train.steps", str(STEPS), "--ckpt.save_every", "2")
    proc = start(script_command("train_grpo.py", args, 3, ("--max-restarts", "3")), log)
    killed = []
    try:
        # "start": a share of the first attempt's start-up (fresh workers to their first step), which differs
        # between CPUs and with the load, or the attempt's first step if that comes sooner; a fixed 12 s outlasted
        # a whole resumed run once start-up got faster
        moments = [("step", rng.randint(3, 7)), ("start", rng.uniform(0.05, 0.8)), ("step", 1)]
        startup = None
        for victim, (kind, when) in zip(rng.sample(range(3), 3), moments):
            previous = set(killed)
            pids = wait_for(lambda: (w := workers(proc.pid)) and len(w) == 3 and not previous & set(w.values()) and w,
                            proc, "a fresh set of 3 workers")
            fresh, base = time.monotonic(), logged_steps(out)
            if kind == "start":
                wait_for(lambda: time.monotonic() > fresh + when * startup or logged_steps(out) > base, proc,
                         "the moment in start-up")
            else:
                wait_for(lambda: logged_steps(out) > base, proc, "a logged step")
                first = time.monotonic()
                startup = startup or first - fresh
                wait_for(lambda: logged_steps(out) >= base + when, proc, f"{when} more logged steps")
                # a moment inside the next step: a fixed 0.5 s was 5 steps on a Zen 5, and the last kill then
                # missed a run that had already ended
                time.sleep(rng.uniform(0.0, 1.0) * (time.monotonic() - first) / max(when - 1, 1))
            os.kill(pids[victim], signal.SIGKILL)
            killed.append(pids[victim])
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        stop(proc)
    text = log.read_text()
    assert len(killed) == 3 and text.count("(exitcode: -9)") == 3, (f"seed {SEED}", text[-3000:])
    assert_same_curve(read_metrics(out), read_metrics(three_role_run), range(1, STEPS + 1))
    assert read_metrics(out)[STEPS]["eval/accuracy"] == pytest.approx(read_metrics(three_role_run)[STEPS]["eval/accuracy"])
    assert (out / "hf" / "model.safetensors").is_file()
