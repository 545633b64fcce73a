"""Run untrusted code isolated and limited, and leave nothing it started running after it: a model's Python
tool calls one program at a time (`run_python`), users' reward functions in a pool of workers (`FunctionPool`).

    results = run_python_many(["print(2 + 2)", "while True: pass"], SandboxConfig(timeout_s=2))
    [r.observation() for r in results]          # ['4\n', '[timed out after 2.0s]\n']

Both hold to the same terms: a fresh process (exec'd, never a forked copy of the caller), limits set in it
(RLIMIT_AS among them), a wall-clock timeout after which it is killed with everything it started, and a result
that says what happened (`SandboxResult`, `Outcome`) instead of an exception in the caller. Model code gets
namespaces too; reward functions are the user's own code, trusted not to be malicious but not to be correct, and
keep the trainer's environment and files (their modules, data files), in workers that outlive one call
(math-verify's import costs a second): see FunctionPool.

A program (`run_isolated`) runs as `unshare --pid --fork --kill-child --mount-proc --net -- prlimit ... --
setpriv ... -- ARGV` in a session of its own (`start_new_session`), with an empty environment, stdin from a file,
stdout/stderr to unlinked files (RLIMIT_FSIZE bounds them; the first `max_output_bytes` of each are read back)
and a fresh working directory that is removed afterwards. What holds:
- As root: a PID namespace with its own /proc, a network namespace (a loopback that is down: "Network is
  unreachable"), and the code runs as uid/gid `cfg.user` with no supplementary groups and no_new_privs, so
  file permissions and RLIMIT_NPROC apply to it.
- Not root: the same namespaces inside a user namespace that maps only the caller (`unshare --user
  --map-current-user`: no capabilities inside either); needs unprivileged user namespaces, else `SandboxError`
  at the first call. The code keeps the caller's own file permissions; RLIMIT_NPROC counts per call.
- Either way: when the code's first process ends, or when the call times out and we kill it, the kernel
  kills every process left in its PID namespace, daemons that left the process group with setsid() included.
  That first process is the namespace's init (pid 1), so signals it sends itself without a handler are ignored.
Not covered: files the code writes outside its working directory (e.g. /tmp) outlive the call; disk use is
bounded per file only; as root, RLIMIT_NPROC counts every process of `cfg.user`, so concurrent calls share
that budget (a call still starts when it is used up, but cannot fork); if the calling process itself is
killed, a call in flight lives until its code ends (RLIMIT_CPU bounds busy code only).
"""

import atexit
import ctypes
import math
import multiprocessing
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from functools import cache
from itertools import repeat
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import BinaryIO, Callable, Literal

from .config import ForgeError

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "run_isolated", "run_python", "run_python_many",
           "FunctionPool", "Outcome"]


_UNSHARE_SIGKILL_BUG = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_PR_SET_PDEATHSIG = 1                   # prctl(2): the signal this process gets when its parent thread ends


class SandboxError(ForgeError):
    """This machine cannot isolate code (no namespaces, a missing tool): nothing is run unisolated instead."""


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0              # wall clock for the whole call; then everything in it is killed
    cpu_seconds: int = 5                # RLIMIT_CPU per process: SIGKILL when used up
    memory_mb: int = 512                # RLIMIT_AS per process: allocations beyond it fail (MemoryError)
    file_size_mb: int = 16              # RLIMIT_FSIZE: every file written, stdout and stderr included
    max_processes: int = 16             # RLIMIT_NPROC: processes of `user`, all concurrent calls together
    max_open_files: int = 64            # RLIMIT_NOFILE
    max_output_bytes: int = 4096        # kept of stdout, and of stderr
    workers: int = 8                    # calls that run_python_many runs at once
    python: str = "/usr/bin/python3"    # must be executable by `user`: a venv under /root is not
    user: int = 65534                   # uid and gid the code runs as when we are root (nobody)


@dataclass
class SandboxResult:
    stdout: str                         # at most max_output_bytes, then a line saying it was truncated
    stderr: str
    exit_code: int | None               # -N: killed by signal N; None: timed out
    timed_out: bool
    seconds: float                      # wall time of the call

    def observation(self, stderr_chars: int = 1000) -> str:
        """What a model sees: its stdout, then why the run failed (if it did) and the end of its stderr."""
        if self.exit_code == 0:
            return self.stdout
        status = f"timed out after {self.seconds:.1f}s" if self.timed_out else _exit_status(self.exit_code)
        return f"{self.stdout}[{status}]\n{self.stderr[-stderr_chars:]}"


def run_isolated(argv: list[str], cfg: SandboxConfig, stdin: bytes = b"") -> SandboxResult:
    """Run `argv` (its program must be executable by cfg.user) isolated and limited as the module docstring
    says, in a fresh working directory; return once no process it started is left."""
    command = [*_namespaces(), *_limits(cfg), *_drop_privileges(cfg), *argv]
    with tempfile.TemporaryDirectory(prefix="forge-sandbox-") as workdir, tempfile.TemporaryFile() as input_file, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if os.geteuid() == 0:
            os.chown(workdir, cfg.user, cfg.user)
        input_file.write(stdin)
        input_file.seek(0)
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=workdir, env={}, stdin=input_file, stdout=out, stderr=err,
                                start_new_session=True)
        timed_out = _wait_or_kill(proc, cfg.timeout_s)
        seconds = time.perf_counter() - start
        exit_code = None if timed_out else _exit_code(proc.returncode, err)
        return SandboxResult(_head(out, cfg.max_output_bytes), _head(err, cfg.max_output_bytes), exit_code,
                             timed_out, seconds)


def run_python(code: str, cfg: SandboxConfig) -> SandboxResult:
    """Run `code` with cfg.python in isolated mode (-I: no user site-packages, no PYTHON* variables). The code
    comes on stdin (an argument is capped at 128 KiB); tracebacks name it "<stdin>"."""
    return run_isolated([cfg.python, "-I", "-"], cfg, stdin=code.encode())


def run_python_many(codes: list[str], cfg: SandboxConfig) -> list[SandboxResult]:
    """run_python for each code, cfg.workers at a time (threads: each one waits on its subprocess); in order."""
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
        return list(pool.map(run_python, codes, repeat(cfg)))


# ---- the command: namespaces, then limits, then the unprivileged user ----

@cache
def _namespaces() -> tuple[str, ...]:
    """`unshare` into new PID (own /proc), mount and network namespaces, tried once: fail loudly, never run bare."""
    user_namespace = () if os.geteuid() == 0 else ("--user", "--map-current-user")
    command = (_tool("unshare"), *user_namespace, "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--")
    probe = subprocess.run([*command, _tool("true")], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"sandbox error: cannot create namespaces as uid {os.geteuid()} "
                           f"({probe.stderr.strip()}); run as root or allow unprivileged user namespaces")
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        raise SandboxError("sandbox error: this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    return command


def _limits(cfg: SandboxConfig) -> list[str]:
    # prlimit in the command, not preexec_fn: preexec_fn may deadlock when other threads exist (Python's docs),
    # and run_python_many calls from threads. One value sets soft and hard: a PID namespace's init ignores
    # SIGXCPU at the soft limit, so the hard limit's SIGKILL is what stops it.
    return [_tool("prlimit"), f"--cpu={cfg.cpu_seconds}", f"--as={cfg.memory_mb << 20}",
            f"--fsize={cfg.file_size_mb << 20}", f"--nproc={cfg.max_processes}",
            f"--nofile={cfg.max_open_files}", "--core=0", "--"]


def _drop_privileges(cfg: SandboxConfig) -> list[str]:
    # Changing uid clears unshare's --kill-child (PR_SET_PDEATHSIG): _wait_or_kill kills the init itself.
    uid = [f"--reuid={cfg.user}", f"--regid={cfg.user}", "--clear-groups"] if os.geteuid() == 0 else []
    return [_tool("setpriv"), *uid, "--no-new-privs", "--"]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxError(f"sandbox error: '{name}' is not on PATH (util-linux and coreutils are needed)")
    return path


# ---- waiting, killing, reading back ----

def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the call; on timeout SIGKILL the PID namespace's init, so the kernel kills everything in the
    namespace, and wait for unshare, which ends only once all of that is gone. True if it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        init = _children(proc.pid)
        with suppress(ProcessLookupError):
            # killing unshare too would return before the namespace is empty; before its fork, it is all there is
            os.kill(init[0] if init else -proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _children(pid: int) -> list[int]:
    """Host pids of `pid`'s children: for unshare, its one child is the PID namespace's init."""
    with suppress(FileNotFoundError), open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]
    return []


def _exit_code(returncode: int, err: BinaryIO) -> int:
    """unshare's exit status, which is its child's (-N: signal N), except when util-linux < 2.40 could not
    re-raise a SIGKILL (RLIMIT_CPU's, or the OOM killer's): it exits 1 and says so last (util-linux#2614)."""
    size = os.fstat(err.fileno()).st_size
    err.seek(max(0, size - len(_UNSHARE_SIGKILL_BUG)))
    if returncode != 1 or err.read() != _UNSHARE_SIGKILL_BUG:
        return returncode
    err.truncate(size - len(_UNSHARE_SIGKILL_BUG))      # unshare's line, not the code's
    return -signal.SIGKILL


def _head(file: BinaryIO, limit: int) -> str:
    """The first `limit` bytes of an output file, decoded, and a line saying so if there was more."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    text = file.read(limit).decode(errors="replace")
    return text + (f"\n[output truncated: {size} bytes, showing the first {limit}]\n" if size > limit else "")


def _exit_status(exit_code: int) -> str:
    return f"killed by signal {-exit_code} ({signal.strsignal(-exit_code)})" if exit_code < 0 \
        else f"exit code {exit_code}"


# ---- persistent workers: functions a config names, called many times (reward functions) ----

@dataclass
class Outcome:
    """One call in a FunctionPool: its number, or why there is none (the caller counts it and scores it 0)."""
    value: float = 0.0
    failure: Literal["error", "timeout"] | None = None
    detail: str = ""                    # the call's traceback, or what became of it or its worker


class FunctionPool:
    """Worker processes, started once, that import the functions `specs` name (as `import_symbol` reads them:
    `name` in `default_module`, `file.py:name`, `module:name`) and call them; each call must return a finite
    number. `map` sends each worker chunks of calls, and its answers come back one by one.

        with FunctionPool(["math_correct"], "rewards", "rewards.functions", workers=2, timeout_s=5) as pool:
            outcomes = pool.map([(0, (completion, row)), ...], deadline_s=60)     # [Outcome], in order

    A call that raises, or returns something that is not a finite number (NaN, inf, a string, None), is an
    "error". One that runs past `timeout_s` is a "timeout": its worker is killed, with every process in its
    process group, and replaced, as is a worker that dies in a call (os._exit, a segfault, memory beyond
    `memory_mb` where the MemoryError cannot be caught); the rest of its chunk goes to the fresh one. What is
    not done `deadline_s` after `map` began is a timeout too. The first time every call of a function in a map
    fails, its first failure is printed on stderr.
    Workers are spawned (a fresh interpreter: nothing the rank holds is shared), lead a process group of their
    own, and get SIGKILL when the thread that started them ends (PR_SET_PDEATHSIG): start and call the pool
    from the rank's main thread. A process a function starts in a session of its own outlives its worker.
    """

    def __init__(self, specs: list[str], default_module: str, key: str, workers: int = 2, timeout_s: float = 5.0,
                 memory_mb: int = 2048):
        self.specs, self.key, self.timeout_s = specs, key, timeout_s
        self._worker_args = (specs, default_module, key, memory_mb, os.getpid())
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
                                   f"({_exit_status(worker.process.exitcode)}; its traceback is above)") from None

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
                                             f"({_exit_status(worker.process.exitcode)})"), time.monotonic(),
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


def _kill(worker: _Worker) -> None:
    with suppress(ProcessLookupError):          # no group yet: it has not reached setsid()
        os.killpg(worker.process.pid, signal.SIGKILL)
    worker.process.kill()
    worker.process.join()
    worker.conn.close()


def _serve_calls(conn: Connection, specs: list[str], default_module: str, key: str, memory_mb: int,
                 parent_pid: int) -> None:
    """A worker: its own process group, killed with its parent, limited; import the functions, then call them
    as chunks come, one answer at a time, until the parent closes the pipe."""
    os.setsid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:              # the parent died before prctl
        os._exit(1)
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    from .config import import_symbol          # here: run_python's callers may bring a config of ForgeError alone
    functions = [import_symbol(spec, default_module, key) for spec in specs]
    conn.send(None)
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        for f, args in chunk:
            conn.send(_call(functions[f], args))


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
