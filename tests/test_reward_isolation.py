"""Reward functions run in FunctionPool's worker processes (forge_core/scoring.py): a function that hangs, dies,
eats memory or returns no number costs its own calls, scored 0 and counted, never the run, and what a call starts
ends with it. Real processes; the functions are loaded by file path, as a user's are, from
tests/rewards_for_tests.py (and strays.py, written by the tests). Last, the real GRPO job with four hostile
functions beside the real one."""

import math
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, grpo_args, read_metrics, run_script
from forge_core.sandbox import SandboxError
from forge_core.scoring import FunctionPool, score

REWARDS_PY = str(REPO / "rewards.py")

HOSTILE = ["sleeps_forever", "exits", "segfaults", "eats_memory", "returns_nan", "returns_inf", "returns_string",
           "returns_none"]
NAMES = ["value_of", "sleeps_on_odd", *HOSTILE, "digit_fraction"]
TIMEOUT_S = 1.0


def spec(name: str) -> str:
    return f"{REPO / 'tests' / 'rewards_for_tests.py'}:{name}"


def calls(name: str, rows: range) -> list[tuple[int, tuple]]:
    return [(NAMES.index(name), ("7 + 5 = 12", {"i": i})) for i in rows]


@pytest.fixture(scope="module")
def pool():
    with FunctionPool([spec(n) for n in NAMES], REWARDS_PY, "rewards.functions", workers=2, timeout_s=TIMEOUT_S,
                      memory_mb=1024) as pool:
        yield pool


def pids(pool: FunctionPool) -> set[int]:
    return {w.process.pid for w in pool._workers}


def test_results_come_back_in_call_order(pool):
    """Several functions interleaved, in chunks over 2 workers: outcome i belongs to call i."""
    mixed = [c for i in range(100) for c in (calls("value_of", [i]) + calls("digit_fraction", [i]))]
    outcomes = pool.map(mixed, deadline_s=30)
    assert [o.value for o in outcomes[::2]] == [float(i) for i in range(100)]
    assert all(o.value == pytest.approx(0.4) and o.failure is None for o in outcomes[1::2])


@pytest.mark.parametrize("name, failure, detail", [
    ("returns_nan", "error", "returned nan, not a finite number"),
    ("returns_inf", "error", "returned -inf, not a finite number"),
    ("returns_string", "error", "returned '1.0', not a finite number"),
    ("returns_none", "error", "TypeError: float() argument must be a string or a real number, not 'NoneType'"),
    ("eats_memory", "error", "MemoryError"),
    ("exits", "error", "its worker died in the call (exit code 3)"),
    ("segfaults", "error", "its worker died in the call (killed by signal 11 (Segmentation fault))"),
    ("sleeps_forever", "timeout", f"still running after {TIMEOUT_S:g}s"),
])
def test_a_bad_call_scores_zero_is_counted_and_the_next_calls_go_on(pool, name, failure, detail):
    """One worker's chunk: good, bad, good, good; the bad one fails in its own way, the good ones still score
    (a dead or killed worker's remaining calls go to a fresh one)."""
    before = pids(pool)
    started = time.monotonic()
    outcomes = pool.map([*calls("value_of", [1]), *calls(name, [2]), *calls("value_of", [3, 4])], deadline_s=30)
    assert [o.value for o in outcomes] == [1.0, 0.0, 3.0, 4.0]
    assert [o.failure for o in outcomes] == [None, failure, None, None]
    assert detail in outcomes[1].detail
    replaced = name in ("exits", "segfaults", "sleeps_forever")
    assert (pids(pool) != before) == replaced
    assert time.monotonic() - started < TIMEOUT_S + 10      # a fresh worker starts in about a second


def test_a_function_that_hangs_on_some_inputs_costs_only_those(pool):
    started = time.monotonic()
    outcomes = pool.map(calls("sleeps_on_odd", range(6)), deadline_s=30)
    assert [o.value for o in outcomes] == [0.0, 0.0, 2.0, 0.0, 4.0, 0.0]
    assert [o.failure for o in outcomes] == [None, "timeout", None, "timeout", None, "timeout"]
    assert time.monotonic() - started < 3 * TIMEOUT_S + 10


def test_the_step_deadline_bounds_a_function_that_hangs_on_every_call(pool):
    """30 hanging calls would take 30 x timeout_s; the deadline ends them at 4 s, and the real function's
    calls, queued behind them, are scored first (the least-served function gets the next free worker)."""
    started = time.monotonic()
    outcomes = pool.map([*calls("sleeps_forever", range(30)), *calls("value_of", range(30))], deadline_s=4)
    assert time.monotonic() - started < 4 + 1.5
    assert all(o.failure == "timeout" for o in outcomes[:30])
    assert "deadline (4s)" in outcomes[29].detail
    assert [o.value for o in outcomes[30:]] == [float(i) for i in range(30)]
    assert pool.map(calls("value_of", [5]), deadline_s=30)[0].value == 5.0     # fresh workers after the deadline


def test_a_function_whose_every_call_fails_is_reported_once(capsys):
    with FunctionPool([spec("returns_nan"), spec("value_of")], REWARDS_PY, "rewards.functions", workers=1) as own:
        for _ in range(2):
            own.map([(0, ("", {"i": 1})), (0, ("", {"i": 2})), (1, ("", {"i": 3}))], deadline_s=30)
    err = capsys.readouterr().err
    assert err.count("every call of") == 1, err
    assert f"every call of '{spec('returns_nan')}' failed in this step (errors: 2, timeouts: 0)" in err
    assert "returned nan, not a finite number" in err


def test_a_function_named_in_rewards_py_by_name():
    with FunctionPool(["addition_correct"], REWARDS_PY, "rewards.functions", workers=1) as own:
        assert [o.value for o in own.map([(0, ("12", {"answer": 12})), (0, ("13", {"answer": 12}))], 30)] == [1, 0]


def test_rewards_weights_weigh_each_function_and_the_terms_stay_unweighted():
    """`rewards.weights` [1, 0.5]: a completion's reward is 1 x value_of + 0.5 x digit_fraction; the per-function
    terms (what `reward/<name>` logs) are the functions' own values."""
    cfg = SimpleNamespace(functions=[spec("value_of"), spec("digit_fraction")], weights=[1.0, 0.5], step_timeout_s=30)
    with FunctionPool(cfg.functions, REWARDS_PY, "rewards.functions", workers=1) as own:
        scored = score(["12ab", "7"], [{"i": 3}, {"i": 4}], own, cfg)
    assert scored["rewards"] == [3 + 0.5 * 0.5, 4 + 0.5 * 1.0]
    assert scored["terms"] == {"value_of": [3.0, 4.0], "digit_fraction": [0.5, 1.0]}


def test_a_worker_that_cannot_start_is_a_clear_error():
    with pytest.raises(SandboxError, match="a worker for rewards.functions did not start"):
        FunctionPool([spec("no_such_function")], REWARDS_PY, "rewards.functions", workers=1)


def test_workers_end_with_the_pool_and_with_a_killed_parent():
    """close() kills and reaps them; a parent killed with SIGKILL (no clean-up runs) takes them along."""
    with FunctionPool([spec("value_of")], REWARDS_PY, "rewards.functions", workers=2) as own:
        workers = [w.process for w in own._workers]
    assert all(p.exitcode is not None for p in workers)
    code = f"""
import os, signal
from forge_core.scoring import FunctionPool
pool = FunctionPool([{spec('sleeps_forever')!r}], {REWARDS_PY!r}, "rewards.functions", workers=2)
print(*(w.process.pid for w in pool._workers), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    orphans = [int(pid) for pid in proc.stdout.split()]
    assert len(orphans) == 2, proc.stderr
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in orphans) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in orphans)


STRAYS_PY = """
import os, subprocess, time


def start_strays(tag):
    \"\"\"A child in a session of its own and a daemon (a double fork and setsid), each named forge-stray-TAG.\"\"\"
    subprocess.Popen(["forge-stray-" + tag, "1000"], executable="/bin/sleep", start_new_session=True)
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["forge-stray-" + tag, "1000"])
        os._exit(0)
    os.waitpid(middle, 0)


def leaves_strays(completion, row):
    start_strays("returned")
    return 1.0


def leaves_strays_and_hangs(completion, row):
    start_strays("hung")
    time.sleep(10**6)


def leaves_strays_and_exits(completion, row):
    start_strays("exited")
    os._exit(3)
"""
STRAYS = ["leaves_strays", "leaves_strays_and_hangs", "leaves_strays_and_exits"]


def running_strays() -> dict[int, str]:
    """pid: command line of each process that strays.py started and that still runs (a zombie has none)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with suppress(FileNotFoundError, ProcessLookupError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if command.startswith(b"forge-stray-"):
                found[int(pid)] = command.decode().replace("\0", " ").strip()
    return found


@pytest.fixture
def strays_py(tmp_path):
    (tmp_path / "strays.py").write_text(STRAYS_PY)
    yield tmp_path / "strays.py"
    for pid in running_strays():                    # none, unless the test failed
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_what_a_call_starts_ends_with_it(strays_py):
    """A function that starts a child in a session of its own and a double-forked daemon: once map returns, none
    of them runs, whether the call returned, ran past timeout_s (its worker killed) or killed its worker, and
    the pool scores the calls after them. A worker's process group was all that ended with it: two steps of a
    job left 1,024 such processes."""
    specs = [f"{strays_py}:{name}" for name in STRAYS] + [spec("value_of")]
    with FunctionPool(specs, REWARDS_PY, "rewards.functions", workers=2, timeout_s=TIMEOUT_S) as own:
        outcomes = own.map([(0, ("", {})), (0, ("", {})), (1, ("", {})), (2, ("", {})), (3, ("", {"i": 7}))],
                           deadline_s=30)
        assert [o.failure for o in outcomes] == [None, None, "timeout", "error", None], outcomes
        assert running_strays() == {}
        assert [o.value for o in own.map([(0, ("", {})), (3, ("", {"i": 8}))], deadline_s=30)] == [1.0, 8.0]
        assert running_strays() == {}


def test_what_a_call_started_ends_with_a_killed_rank(strays_py, tmp_path):
    """A rank killed with SIGKILL in a call: its workers end (PR_SET_PDEATHSIG), and what the call started with
    them."""
    code = f"""
import os, signal, threading
from forge_core.scoring import FunctionPool
pool = FunctionPool([{f"{strays_py}:leaves_strays_and_hangs"!r}], {REWARDS_PY!r},
                    "rewards.functions", workers=1, timeout_s=60)
threading.Timer(2, os.kill, (os.getpid(), signal.SIGKILL)).start()
pool.map([(0, ("", {{}}))], deadline_s=60)
"""
    with open(tmp_path / "stderr", "w+") as stderr:        # not a pipe, which the strays would hold open
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, stderr=stderr, timeout=120)
        assert proc.returncode == -signal.SIGKILL, stderr.seek(0) or stderr.read()
    deadline = time.monotonic() + 10
    while (left := running_strays()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == {}


def test_hostile_rewards_cost_their_calls_not_the_grpo_run(tiny, tmp_path):
    """3 ranks, 2 steps, the real reward beside one that sleeps forever, one that calls os._exit, one that
    returns NaN and one a string (the first also the held-out accuracy function): the run ends normally, every
    step counts their errors and timeouts, the real reward is scored, and nothing non-finite reaches the
    metrics."""
    hostile = ["sleeps_forever", "exits", "returns_nan", "returns_string"]
    functions = [f"tests/rewards_for_tests.py:{n}" for n in ["digit_fraction", *hostile]]
    proc = run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", "2", "--rewards.functions",
                                                 *functions, "--rewards.timeout_s", "1",
                                                 "--rewards.step_timeout_s", "4",
                                                 "--rewards.accuracy", "sleeps_forever"), nproc=3)
    metrics = read_metrics(tmp_path)
    for step in (1, 2):
        m = metrics[step]
        assert m["reward/errors"] >= 2 * 64 and m["reward/timeouts"] >= 1, m      # 64 completions a step
        assert m["reward/digit_fraction"] > 0 and m["reward/mean"] == pytest.approx(m["reward/digit_fraction"])
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert "held-out accuracy: greedy 0.000 -> 0.000" in proc.stdout     # the eval's function hangs: scored 0
    for name in hostile:
        once_per_pool = 2 if name == "sleeps_forever" else 1      # the policy rank's eval pool reports it too
        assert proc.stderr.count(f"every call of 'tests/rewards_for_tests.py:{name}' failed") == once_per_pool, \
            proc.stderr[-3000:]
