"""Run untrusted code (a model's Python tool calls) isolated and limited, and leave nothing it started running
after the call. Users' reward functions run in worker processes on the same terms (forge_core/scoring.py).

    results = run_python_many(["print(2 + 2)", "while True: pass"], SandboxConfig(timeout_s=2))
    [r.observation() for r in results]          # ['4\n', '[timed out after 2.0s]\n']

Each call (`run_isolated`) runs as `unshare --pid --fork --kill-child --mount-proc --net -- prlimit ... --
setpriv ... -- ARGV` in a session of its own (`start_new_session`), with an empty environment, stdin from a file,
stdout/stderr to unlinked files (RLIMIT_FSIZE bounds them; the first `max_output_bytes` of each are read back)
and a fresh working directory that is removed afterwards. What holds:
- As root: a PID namespace with its own /proc, a network namespace (a loopback that is down: "Network is
  unreachable"), and the code runs as uid/gid `cfg.user` with no supplementary groups and no_new_privs, so
  file permissions and RLIMIT_NPROC apply to it. Its working directory has a random name in a directory that
  it may pass through but not list, so calls that run at once cannot find each other's files.
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

import os
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from functools import cache
from itertools import repeat
from typing import BinaryIO

from .config import ForgeError

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "run_isolated", "run_python", "run_python_many",
           "exit_status"]


_UNSHARE_SIGKILL_BUG = b"unshare: sigprocmask unblock failed: Invalid argument\n"


class SandboxError(ForgeError):
    """This machine cannot isolate code (no namespaces, a missing tool): nothing is run unisolated instead."""


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0              # wall clock for the whole call; then everything in it is killed
    cpu_seconds: int = 5                # RLIMIT_CPU per process: SIGKILL when used up
    memory_mb: int = 512                # RLIMIT_AS per process: allocations beyond it fail (MemoryError)
    file_size_mb: int = 16              # RLIMIT_FSIZE: every file written, stdout and stderr included
    max_processes: int = 16             # RLIMIT_NPROC: as root, processes of `user` on the machine (all calls at once)
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
        status = f"timed out after {self.seconds:.1f}s" if self.timed_out else exit_status(self.exit_code)
        return f"{self.stdout}[{status}]\n{self.stderr[-stderr_chars:]}"


def run_isolated(argv: list[str], cfg: SandboxConfig, stdin: bytes = b"") -> SandboxResult:
    """Run `argv` (its program must be executable by cfg.user) isolated and limited as the module docstring
    says, in a fresh working directory; return once no process it started is left."""
    command = [*_namespaces(), *_limits(cfg), *_drop_privileges(cfg), *argv]
    with tempfile.TemporaryDirectory(prefix="forge-sandbox-") as hidden, tempfile.TemporaryFile() as input_file, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # Concurrent calls run as the same uid: each working directory has a random name inside a directory that
        # uid may pass through but not list, so no call can find another's files
        workdir = tempfile.mkdtemp(dir=hidden)
        if os.geteuid() == 0:
            os.chmod(hidden, 0o711)
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


def exit_status(exit_code: int) -> str:
    """How a process that did not exit 0 ended, in words."""
    return f"killed by signal {-exit_code} ({signal.strsignal(-exit_code)})" if exit_code < 0 \
        else f"exit code {exit_code}"
