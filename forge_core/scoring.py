"""Score completions with users' reward functions, isolated: worker processes that a function which hangs, crashes,
eats memory or returns no number cannot take down (`FunctionPool`), and the reward config's view of it.

Workers hold to the sandbox's terms (forge_core/sandbox.py): a fresh process (exec'd, never a forked copy of the
caller), limits set in it (RLIMIT_AS among them), a wall-clock timeout after which it is killed with everything
it started, and a result that says what happened (`Outcome`) instead of an exception in the caller. Unlike model
code they get no namespaces: reward functions are the user's own code, trusted not to be malicious but not to be
correct, and keep the trainer's environment and files (their modules, data files), in workers that outlive one
call (math-verify's import costs a second).

    pool = reward_pool(cfg.rewards, "rewards.py")         # once per rank
    scores = score(completions, rows, pool, cfg.rewards)  # {"rewards", "terms", "errors", "timeouts"}
"""

import atexit
import ctypes
import math
import multiprocessing
import os
import resource
import select
import signal
import sys
import time
import traceback
import types
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Callable, Literal, NoReturn

from .config import ForgeError, import_symbol
from .processes import become_subreaper, kill_descendants, reap_children
from .sandbox import SandboxError, exit_status

__all__ = ["FunctionPool", "Outcome", "RewardModel", "function_names", "load_reward_functions", "reward_pool",
           "score", "accuracy_scorer"]

_PR_SET_PDEATHSIG = 1                   # prctl(2): the signal this process gets when its parent thread ends
_KEY = "rewards.functions"              # what an error names


# ---- the reward config's functions (a train_grpo.py RewardConfig: functions, weights, workers, timeouts) ----

def function_names(cfg) -> list[str]:
    """`rewards.functions` as the metrics name them: `addition_correct`, `my.py:brevity` -> `brevity`."""
    return [spec.rpartition(":")[2] for spec in cfg.functions]


def load_reward_functions(cfg, default_file: str) -> dict[str, Callable[[str, dict], float]]:
    """The functions, imported here to check the names; training calls them in a `reward_pool`'s workers. A bare
    name is one in `default_file` (the script's neighbour `rewards.py`)."""
    functions = {name: import_symbol(spec, default_file, _KEY)
                 for name, spec in zip(function_names(cfg), cfg.functions)}
    for name, fn in functions.items():
        if not callable(fn):
            raise ForgeError(f"config error: rewards.functions: '{name}' is not a function")
    if cfg.weights is not None and len(cfg.weights) != len(functions):
        raise ForgeError(f"config error: rewards.weights has {len(cfg.weights)} values for "
                         f"{len(functions)} rewards.functions")
    return functions


def reward_pool(cfg, default_file: str) -> "FunctionPool":
    return FunctionPool(cfg.functions, default_file, _KEY, cfg.workers, cfg.timeout_s, cfg.memory_mb)


def score(completions: list[str], rows: list[dict], pool: "FunctionPool", cfg) -> dict[str, list]:
    """Per completion the weighted sum of the reward functions and its calls that failed, scored 0 ("errors":
    raised or gave no finite number, "timeouts": out of time); per function its values ("terms")."""
    names = function_names(cfg)
    weights, F = cfg.weights or [1.0] * len(names), len(names)
    outcomes = pool.map([(f, (text, row)) for text, row in zip(completions, rows) for f in range(F)],
                        cfg.step_timeout_s)
    per_text = [outcomes[i * F:(i + 1) * F] for i in range(len(completions))]
    return {"rewards": [sum(w * o.value for w, o in zip(weights, calls)) for calls in per_text],
            "terms": {name: [calls[f].value for calls in per_text] for f, name in enumerate(names)},
            "errors": [sum(o.failure == "error" for o in calls) for calls in per_text],
            "timeouts": [sum(o.failure == "timeout" for o in calls) for calls in per_text]}


def accuracy_scorer(pool: "FunctionPool", cfg, name: str) -> Callable[[list[str], list[dict]], list[float]]:
    """The held-out accuracy function `name` (one of rewards.functions), scored in the pool's workers."""
    f = function_names(cfg).index(name)
    return lambda texts, rows: [o.value for o in pool.map([(f, (t, r)) for t, r in zip(texts, rows)],
                                                          cfg.step_timeout_s)]


class RewardModel:
    """An HF sequence-classification model (`rewards.model_path`): the score of (prompt, completion) is its
    first logit."""

    def __init__(self, path: str, trust_remote_code: bool, device):
        from transformers import AutoModelForSequenceClassification
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, trust_remote_code=trust_remote_code).to(device).eval()

    def __call__(self, batch: dict, index: list[int]) -> list[float]:
        import torch            # not at the top: reward workers import this module, and need no torch
        ids = torch.cat([batch["prompt_ids"][index], batch["completion_ids"][index]], 1)
        mask = torch.cat([batch["prompt_mask"][index], batch["completion_mask"][index]], 1)
        with torch.no_grad():
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()


# ---- the pool ----

@dataclass
class Outcome:
    """One call in a FunctionPool: its number, or why there is none (the caller counts it and scores it 0)."""
    value: float = 0.0
    failure: Literal["error", "timeout"] | None = None
    detail: str = ""                    # the call's traceback, or what became of it or its worker


class FunctionPool:
    """Worker processes, started once, that import the functions `specs` name (as `import_symbol` reads them:
    `name` in `default_file`, `file.py:name`, `module:name`) and call them; each call must return a finite
    number. `map` sends each worker chunks of calls, and its answers come back one by one.

        with FunctionPool(["math_correct"], "rewards.py", "rewards.functions", workers=2, timeout_s=5) as pool:
            outcomes = pool.map([(0, (completion, row)), ...], deadline_s=60)     # [Outcome], in order

    A call that raises, or returns something that is not a finite number (NaN, inf, a string, None), is an
    "error". One that runs past `timeout_s` is a "timeout": its worker is killed, with every process it started,
    and replaced, as is a worker that dies in a call (os._exit, a segfault, memory beyond `memory_mb` where the
    MemoryError cannot be caught); the rest of its chunk goes to the fresh one. What is not done `deadline_s`
    after `map` began is a timeout too. The first time every call of a function in a map fails, its first
    failure is printed on stderr.
    Workers are spawned (a fresh interpreter: nothing the rank holds is shared), and end with the thread that
    started them (PR_SET_PDEATHSIG): start and call the pool from the rank's main thread. Each is a supervisor
    and the process it forks to call the functions, both child subreapers, so that every process a call starts
    stays below them, daemons that left its session included: after each call, what it started is killed, and a
    worker that dies, is killed or loses its rank takes what it started with it.
    """

    def __init__(self, specs: list[str], default_file: str, key: str, workers: int = 2, timeout_s: float = 5.0,
                 memory_mb: int = 2048):
        self.specs, self.key, self.timeout_s = specs, key, timeout_s
        self._worker_args = (specs, default_file, key, memory_mb, os.getpid())
        self._context = multiprocessing.get_context("spawn")
        self._reported: set[int] = set()
        self._workers = [self._start() for _ in range(workers if specs else 0)]
        atexit.register(self.close)
        for worker in self._workers:
            try:
                worker.ready = worker.conn.recv() is None
            except EOFError:
                worker.process.join()
                self.close()
                raise SandboxError(f"sandbox error: a worker for {key} did not start "
                                   f"({exit_status(worker.process.exitcode)}; its traceback is above)") from None

    def map(self, calls: list[tuple[int, tuple]], deadline_s: float) -> list[Outcome]:
        """`specs[f](*args)` for each `(f, args)`, in parallel; the outcomes in order, within `deadline_s`."""
        batch = _Batch.split(calls, chunks_per_function=4 * len(self._workers))
        deadline = time.monotonic() + deadline_s
        while (now := time.monotonic()) < deadline and batch.left:
            for worker in self._workers:
                if worker.ready and not worker.calls and (chunk := self._next_chunk(batch, now)):
                    worker.calls, worker.started = chunk, now
                    with suppress(BrokenPipeError):      # it died idle: _collect sees it, the chunk goes on
                        worker.conn.send([calls[i] for i in chunk])
            waiting = [w for w in self._workers if w.calls or not w.ready]
            wake = min([deadline, *(w.started + self.timeout_s for w in waiting if w.calls)])
            connection.wait([h for w in waiting for h in (w.conn, w.process.sentinel)], max(wake - now, 0))
            for worker in waiting:
                self._collect(worker, batch)
        for worker in [w for w in self._workers if w.calls]:     # its answers would come after the deadline
            self._restart(worker, batch)
        late = Outcome(failure="timeout", detail=f"not done within the step's deadline ({deadline_s:g}s)")
        batch.outcomes = [late if o is None else o for o in batch.outcomes]
        self._report(batch)
        return batch.outcomes

    def close(self) -> None:
        """Kill and reap every worker (and what it started); the pool cannot be used after this."""
        for worker in self._workers:
            _kill(worker)
        self._workers = []
        atexit.unregister(self.close)

    def __enter__(self) -> "FunctionPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> "_Worker":
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=_serve_calls, args=(child_end, *self._worker_args), name="forge-pool")
        # spawn first re-runs the parent's __main__ in the child (runpy, as __mp_main__): for train_grpo.py that
        # is ~10 s of torch and vLLM imports per worker, paid again at every replacement. A worker needs none of it.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            process.start()
        finally:
            sys.modules["__main__"] = main
        child_end.close()
        return _Worker(process, parent_end)

    def _next_chunk(self, batch: "_Batch", now: float) -> list[int] | None:
        """The next chunk of the function that has had the least worker time in this map (calls still running
        included; then the fewest workers): one that hangs or kills its workers cannot keep the others from them."""
        running = [(batch.calls[w.calls[0]][0], now - w.started) for w in self._workers if w.calls]
        waiting = [f for f, queue in batch.queues.items() if queue]
        if not waiting:
            return None
        f = min(waiting, key=lambda f: (batch.seconds[f] + sum(t for g, t in running if g == f),
                                        sum(g == f for g, _ in running)))
        return batch.queues[f].popleft()

    def _collect(self, worker: "_Worker", batch: "_Batch") -> None:
        """Take the worker's answers; replace it if it died, or if its current call ran past timeout_s."""
        died = worker.process.exitcode is not None      # read first: what it sent before it died is still read
        answers = select.poll()                         # Connection.poll() builds a selector per call: 10x slower
        answers.register(worker.conn, select.POLLIN)
        try:
            while answers.poll(0):
                answer = worker.conn.recv()             # a float, an Outcome, or None: ready
                if worker.ready:
                    batch.settle(worker, Outcome(answer) if isinstance(answer, float) else answer, time.monotonic())
                worker.ready = True
        except (EOFError, OSError):
            died = True
        if died:
            worker.process.join()
            if worker.calls:    # charged as a timeout: the fresh worker costs its function about as much
                batch.settle(worker, Outcome(failure="error", detail=f"its worker died in the call "
                                             f"({exit_status(worker.process.exitcode)})"), time.monotonic(),
                             charge_s=self.timeout_s)
            self._restart(worker, batch)
        elif worker.calls and time.monotonic() - worker.started > self.timeout_s:
            batch.settle(worker, Outcome(failure="timeout", detail=f"still running after {self.timeout_s:g}s "
                                         "(timeout_s): its worker was killed"), time.monotonic())
            self._restart(worker, batch)

    def _restart(self, worker: "_Worker", batch: "_Batch") -> None:
        """Kill the worker and start a fresh one in its place; its unanswered calls go back to the front."""
        if worker.calls:
            batch.queues[batch.calls[worker.calls[0]][0]].appendleft(worker.calls)
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _report(self, batch: "_Batch") -> None:
        """Once per function: when every one of its calls in a map failed, say so with its first failure."""
        for f in sorted(set(batch.queues) - self._reported):
            outcomes = [o for (g, _), o in zip(batch.calls, batch.outcomes) if g == f]
            if all(o.failure for o in outcomes):
                self._reported.add(f)
                errors = sum(o.failure == "error" for o in outcomes)
                print(f"{self.key}: every call of '{self.specs[f]}' failed in this step (errors: {errors}, timeouts: "
                      f"{len(outcomes) - errors}); said once per function. The first failure:\n{outcomes[0].detail}",
                      file=sys.stderr, flush=True)


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False                 # it imported the functions and waits for calls
    calls: list[int] = field(default_factory=list)   # call indices sent to it and not answered yet, in order
    started: float = 0.0                # when calls[0] began: its chunk was sent, or the previous answer came


@dataclass
class _Batch:
    """One `map`'s calls, their outcomes so far, and its chunks not sent yet."""
    calls: list[tuple[int, tuple]]
    outcomes: list[Outcome | None]
    queues: dict[int, deque[list[int]]]     # function -> chunks of call indices, in call order
    seconds: dict[int, float]               # function -> worker seconds its answered calls took
    left: int                               # calls without an outcome

    @classmethod
    def split(cls, calls: list[tuple[int, tuple]], chunks_per_function: int) -> "_Batch":
        by_function: dict[int, list[int]] = {}
        for i, (f, _) in enumerate(calls):
            by_function.setdefault(f, []).append(i)
        queues = {}
        for f, index in by_function.items():
            size = math.ceil(len(index) / chunks_per_function)
            queues[f] = deque(index[i:i + size] for i in range(0, len(index), size))
        return cls(calls, [None] * len(calls), queues, dict.fromkeys(queues, 0.0), len(calls))

    def settle(self, worker: _Worker, outcome: Outcome, now: float, charge_s: float = 0.0) -> None:
        """The outcome of the worker's current call; the next one in its chunk starts now."""
        i = worker.calls.pop(0)
        self.outcomes[i] = outcome
        self.left -= 1
        self.seconds[self.calls[i][0]] += now - worker.started + charge_s
        worker.started = now


# ---- a worker: a supervisor, and the process it forks to call the functions ----

def _kill(worker: _Worker) -> None:
    """Kill the worker with everything it started, and reap it. Stopped first, it neither reaps nor starts
    anything while its descendants (all that it started: it is a subreaper) are killed."""
    with suppress(ProcessLookupError):
        os.kill(worker.process.pid, signal.SIGSTOP)
    kill_descendants(worker.process.pid)
    worker.process.kill()
    worker.process.join()
    worker.conn.close()


def _serve_calls(conn: Connection, specs: list[str], default_file: str, key: str, memory_mb: int,
                 parent_pid: int) -> None:
    """A worker's supervisor: a process group of its own (a Ctrl-C at the terminal reaches the rank, not the
    calls), ended with its parent; it forks the caller, and when that ends, kills what it left and ends as it
    did."""
    os.setsid()
    signal.signal(signal.SIGTERM, lambda *_: _end_as(1))
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)     # handled: what the calls started dies too
    if os.getppid() != parent_pid:              # the parent died before prctl
        os._exit(1)
    become_subreaper()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    supervisor = os.getpid()
    if caller := os.fork():
        conn.close()
        _end_as(os.waitstatus_to_exitcode(os.waitpid(caller, 0)[1]))
    _call_functions(conn, specs, default_file, key, memory_mb, supervisor)


def _call_functions(conn: Connection, specs: list[str], default_file: str, key: str, memory_mb: int,
                    supervisor: int) -> NoReturn:
    """A worker's caller: killed with its supervisor, limited; import the functions, then call them as chunks
    come, one answer at a time, until the parent closes the pipe. After each call, every process the call
    started is killed (a subreaper, the caller holds them all) before the answer goes."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:
        os._exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    become_subreaper()
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    functions = [import_symbol(spec, default_file, key) for spec in specs]
    conn.send(None)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            os._exit(0)
        for f, args in chunk:
            outcome = _call(functions[f], args)
            kill_descendants(os.getpid())
            reap_children()
            conn.send(outcome)


def _end_as(exit_code: int) -> NoReturn:
    """Kill every process below this one, then end with `exit_code` (-N: by signal N), the caller's."""
    kill_descendants(os.getpid())
    if exit_code < 0:
        signal.signal(-exit_code, signal.SIG_DFL)
        os.kill(os.getpid(), -exit_code)
    os._exit(exit_code if exit_code >= 0 else 1)        # a signal whose default is to be ignored


def _call(fn: Callable, args: tuple) -> float | Outcome:
    try:
        value = fn(*args)
        number = math.nan if isinstance(value, (str, bytes)) else float(value)
        if math.isfinite(number):
            return number                       # pickled and read back in a tenth of an Outcome's time
        detail = f"returned {value!r:.200}, not a finite number"
    except BaseException:                       # sys.exit() as well: the worker goes on with the next call
        detail = traceback.format_exc()
    return Outcome(failure="error", detail=detail)
