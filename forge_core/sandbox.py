"""Run untrusted code (a model's Python tool calls) isolated and limited, and leave nothing it started running
after the call. Users' reward functions run in worker processes on terms of their own (forge_core/scoring.py).

    results = run_python_many(["print(2 + 2)", "while True: pass"], SandboxConfig(timeout_s=2))
    [r.observation() for r in results]          # ['4\n', '[timed out after 2.0s]\n']

Each call (`run_isolated`) runs in cgroups of its own (forge_core/cgroups.py) as `unshare --pid --fork --kill-child
--mount-proc --net --ipc --uts --cgroup -- sh -c MOUNTS -- python ENTER -- prlimit ... -- setpriv ... -- ARGV` in a
session of its own (`start_new_session`), with an empty environment, stdin from a file and stdout/stderr to unlinked
files (RLIMIT_FSIZE bounds them; the first `max_output_bytes` of each are read back). MOUNTS builds a new root and
chroots into it (forge_core/rootfs.py): the system directories, the interpreter's installation, /proc and two
devices, read-only, the few files of /etc that programs read, and a tmpfs of `disk_mb` on /tmp and /dev/shm, the
working directory, gone with the call; the caller's files, the job's data (its answers too) and every other mount
are not in it. ENTER (`cfg.python -I -S`, still privileged) names the host "sandbox", loads the call's seccomp
filter (forge_core/seccomp.py) and cds to /tmp. What holds:
- As root: PID (with its own /proc), network (a loopback that is down: "Network is unreachable"), IPC, UTS and
  cgroup namespaces, and the code runs with no supplementary groups and no_new_privs as a uid/gid of its own:
  one of `first_user` .. `first_user + users - 1` that no other call on this machine runs as while it runs (an
  flock on a file in a root-only directory holds it; a call waits while all are taken). So file permissions
  apply, RLIMIT_NPROC counts this call's processes only, and calls that run at once share nothing.
- Not root: the same namespaces inside a user namespace that maps only the caller, as its root
  (`unshare --user --map-root-user`), which builds the root and then runs the code with no capabilities (an
  empty bounding set): uid 0 inside, the caller's file permissions on what the root holds, all of it read-only.
  Needs unprivileged user namespaces and a cgroup delegated to the caller, else `SandboxError` at the first call.
- Either way, the call's cgroups bound it as a whole: its processes, pipes, memfds and /tmp share `memory_mb`
  (beyond it the OOM killer kills its largest process), its processes and threads are at most `max_processes`, and
  it runs on at most `cpus` CPUs at once (its CPU time is at most cpus x timeout_s). Where no such cgroup can be
  made, `SandboxError` at the first call, never a call without them. This process's calls at once hold at most
  `total_memory_mb` (a call that does not fit waits to start): the host's bound is ranks x total_memory_mb.
- The seccomp filter makes the syscalls that no tool needs (bpf, io_uring, ptrace, mounts...) fail with EPERM and
  kills a process that makes another architecture's syscalls; RLIMIT_MEMLOCK is 0.
- When the code's first process ends, or when the call times out and we kill it, the kernel kills every process
  left in its PID namespace, daemons that left the process group with setsid() included, and then what is left in
  its cgroups is killed. That first process is the namespace's init (pid 1), so signals it sends itself without a
  handler are ignored. When the calling process is killed, its calls in flight die with it (PR_SET_PDEATHSIG).
Not covered: the code reads what its uid may read in the system directories; where the machine allows
unprivileged user namespaces, it may make its own (the filter and the cgroups hold in them too).
"""

import fcntl
import os
import signal
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from itertools import repeat
from pathlib import Path
from typing import BinaryIO, Iterator

from .cgroups import Hierarchy, MemoryBudget, call_cgroups, find_hierarchies, join, remove_stale
from .config import ForgeError
from .rootfs import private_root, tool
from .seccomp import syscall_filter

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "run_isolated", "run_python", "run_python_many",
           "exit_status"]


_UNSHARE_SIGKILL_BUG = b"unshare: sigprocmask unblock failed: Invalid argument\n"
_MEMORY = MemoryBudget()                # of this process's calls in flight


class SandboxError(ForgeError):
    """This machine cannot isolate or bound code (no namespaces, no cgroups, a missing tool): nothing is run
    unisolated instead."""


@dataclass
class SandboxConfig:
    timeout_s: float = 5.0              # wall clock for the whole call; then everything in it is killed
    cpu_seconds: int = 5                # RLIMIT_CPU per process: SIGKILL when used up
    cpus: float = 1.0                   # CPUs the whole call runs on at most at once (its cgroup's CPU quota)
    memory_mb: int = 512                # the whole call's memory, its /tmp included (its cgroup); RLIMIT_AS per
                                        # process too, so that one allocation beyond it fails (MemoryError)
    total_memory_mb: int = 4096         # memory_mb of all of this process's calls at once: a call waits for its share
    file_size_mb: int = 16              # RLIMIT_FSIZE: every file written, stdout and stderr included
    disk_mb: int = 64                   # the call's /tmp (a tmpfs, in memory): all it may write
    max_processes: int = 16             # the call's processes and threads (pids.max), and RLIMIT_NPROC
    max_open_files: int = 64            # RLIMIT_NOFILE
    max_output_bytes: int = 4096        # kept of stdout, and of stderr
    workers: int = 8                    # calls that run_python_many runs at once
    python: str = "/usr/bin/python3"    # or a venv's: its installation is bound into the call's root
    first_user: int = 60000             # as root, each call runs as its own uid/gid of first_user .. + users - 1
    users: int = 1000                   # (isolate's range for its boxes); calls at once beyond that wait


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
    """Run `argv` (its program must be executable by any user) isolated and limited as the module docstring
    says, in a fresh /tmp; return once no process it started is left."""
    _check_program(cfg.python, argv[0])
    if cfg.memory_mb > cfg.total_memory_mb:
        raise SandboxError(f"sandbox error: memory_mb {cfg.memory_mb} is more than total_memory_mb "
                           f"{cfg.total_memory_mb}, so the call could never start")
    with _MEMORY.held(cfg.memory_mb, cfg.total_memory_mb), _own_user(cfg) as uid, \
            _call_cgroups(cfg, _hierarchies()) as cgroups, tempfile.TemporaryFile() as input_file, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        command = [*_dies_with_caller(), *join(cgroups, _tool("sh")), *_namespaces(),
                   *_private_root(cfg.disk_mb, uid, cfg.python, argv[0]), *_limits(cfg), *_drop_privileges(uid), *argv]
        input_file.write(stdin)
        input_file.seek(0)
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd="/", env={}, stdin=input_file, stdout=out, stderr=err,
                                start_new_session=True)
        timed_out = _wait_or_kill(proc, cfg.timeout_s)
        seconds = time.perf_counter() - start
        exit_code = _exit_code(proc.returncode, err)         # drops unshare's own line, as a timeout has it too
        return SandboxResult(_head(out, cfg.max_output_bytes), _head(err, cfg.max_output_bytes),
                             None if timed_out else exit_code, timed_out, seconds)


def run_python(code: str, cfg: SandboxConfig) -> SandboxResult:
    """Run `code` with cfg.python in isolated mode (-I: no user site-packages, no PYTHON* variables). The code
    comes on stdin (an argument is capped at 128 KiB); tracebacks name it "<stdin>"."""
    return run_isolated([cfg.python, "-I", "-"], cfg, stdin=code.encode())


def run_python_many(codes: list[str], cfg: SandboxConfig) -> list[SandboxResult]:
    """run_python for each code, cfg.workers at a time (threads: each one waits on its subprocess); in order."""
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
        return list(pool.map(run_python, codes, repeat(cfg)))


# ---- the command: cgroups, namespaces, a private root, then limits, then the unprivileged user ----

@cache
def _namespaces() -> tuple[str, ...]:
    """`unshare` into new PID (own /proc), mount, network, IPC, UTS and cgroup namespaces, tried once (and the
    private root once per program, `_check_program`): fail loudly, never run bare."""
    user_namespace = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    command = (_tool("unshare"), *user_namespace, "--pid", "--fork", "--kill-child", "--mount-proc", "--net",
               "--ipc", "--uts", "--cgroup", "--")
    probe = subprocess.run([*command, _tool("true")], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"sandbox error: cannot create namespaces as uid {os.geteuid()} "
                           f"({probe.stderr.strip()}); run as root or allow unprivileged user namespaces")
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        raise SandboxError("sandbox error: this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    return command


@cache
def _check_program(python: str, program: str) -> None:
    """Once per program: its installation and the interpreter's bind into the call's root, ENTER runs there and
    the program is there to run; else one line now, where every call would fail and the model would read the
    failure as its own code's."""
    probe = subprocess.run([*_namespaces(), *_private_root(1, None, python, program), _tool("test"), "-x", program],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"sandbox error: {program} cannot run in the call's root "
                           f"({' '.join(probe.stderr.split()) or 'not there'})")


def _private_root(disk_mb: int, uid: int | None, python: str, program: str) -> list[str]:
    """Inside the namespaces, still privileged there: into the call's root (forge_core/rootfs.py), then ENTER."""
    with _lacking():
        return private_root(disk_mb, uid, python, program, [python, "-I", "-S", "-c", ENTER, syscall_filter()])


ENTER = """
import ctypes, os, sys
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, ctypes.c_ulong(2)
class Program(ctypes.Structure):    # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
libc, bpf = ctypes.CDLL(None, use_errno=True), bytes.fromhex(sys.argv[1])
program = Program(len(bpf) // 8, bpf)
if libc.sethostname(b"sandbox", 7) or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program)):
    sys.exit("sandbox: " + os.strerror(ctypes.get_errno()))
os.chdir("/tmp")
os.execve(sys.argv[2], sys.argv[2:], {})
"""     # the call's last step as root of its namespaces, in its root: ENTER FILTER-IN-HEX COMMAND...


@contextmanager
def _own_user(cfg: SandboxConfig) -> Iterator[int | None]:
    """As root: a uid of cfg's range that no other call on this machine (any process) runs as now, held by an
    flock for the call; it is free again only once the call's last process is gone. Not root: None (the
    caller's own user namespace is the call's)."""
    if os.geteuid() != 0:
        yield None
        return
    locks = _user_locks()
    while True:
        for uid in range(cfg.first_user, cfg.first_user + cfg.users):
            with open(locks / str(uid), "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                yield uid
                return
        time.sleep(0.01)


@cache
def _user_locks() -> Path:
    """The files whose flocks hold the calls' uids: in a directory that only root may enter or change."""
    path = Path(tempfile.gettempdir()) / "forge-sandbox-users"
    with suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        raise SandboxError(f"sandbox error: {path} must be a directory of root's that only root may enter")
    return path


def _limits(cfg: SandboxConfig) -> list[str]:
    # prlimit in the command, not preexec_fn: preexec_fn may deadlock when other threads exist (Python's docs),
    # and run_python_many calls from threads. One value sets soft and hard: a PID namespace's init ignores
    # SIGXCPU at the soft limit, so the hard limit's SIGKILL is what stops it.
    return [_tool("prlimit"), f"--cpu={cfg.cpu_seconds}", f"--as={cfg.memory_mb << 20}",
            f"--fsize={cfg.file_size_mb << 20}", f"--nproc={cfg.max_processes}",
            f"--nofile={cfg.max_open_files}", "--core=0", "--memlock=0", "--"]


def _dies_with_caller() -> list[str]:
    # unshare gets SIGKILL when the thread that started it ends (the caller killed), and the code (below) when
    # unshare does; the kernel then kills the rest of the PID namespace, and the call's uid is free for another
    return [_tool("setpriv"), "--pdeathsig=KILL", "--"]


def _drop_privileges(uid: int | None) -> list[str]:
    # Changing uid clears unshare's --kill-child (PR_SET_PDEATHSIG), which setpriv sets again after it.
    # Not root, the code runs as root of its user namespace: an empty bounding set leaves it no capabilities.
    user = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None \
        else ["--bounding-set=-all", "--inh-caps=-all"]
    return [_tool("setpriv"), *user, "--no-new-privs", "--pdeathsig=KILL", "--"]


def _tool(name: str) -> str:
    with _lacking():
        return tool(name)


@contextmanager
def _lacking() -> Iterator[None]:
    """What this machine lacks for a call (a tool, libseccomp, a program's own installation), in one line."""
    try:
        yield
    except OSError as err:
        raise SandboxError(f"sandbox error: {err}") from None


# ---- cgroups: the call's memory, processes and CPU as a whole (forge_core/cgroups.py) ----

@cache
def _hierarchies() -> tuple[Hierarchy, ...]:
    """Where this process's calls get their cgroups, tried once (a call's cgroups made, joined and removed):
    else one line, never a call that runs unbounded."""
    try:
        hierarchies = find_hierarchies()
        remove_stale(hierarchies)
        with _call_cgroups(SandboxConfig(), hierarchies) as cgroups:
            joined = subprocess.run([*join(cgroups, _tool("sh")), _tool("true")], capture_output=True, text=True)
        problem = joined.stderr.strip() if joined.returncode else ""
    except OSError as err:
        problem = str(err)
    if problem:
        raise SandboxError(f"sandbox error: cannot make a call's cgroups ({problem}), without which its memory, "
                           f"processes and CPU are unbounded; run as root or in a cgroup delegated to uid "
                           f"{os.geteuid()}")
    return hierarchies


def _call_cgroups(cfg: SandboxConfig, hierarchies: tuple[Hierarchy, ...]) -> AbstractContextManager[list[Path]]:
    # pids.max counts unshare too, which is outside the PID namespace
    return call_cgroups(hierarchies, cfg.memory_mb, cfg.max_processes + 1, cfg.cpus)


# ---- waiting, killing, reading back ----

def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the call; on timeout SIGKILL the PID namespace's init, so the kernel kills everything in the
    namespace, and wait for unshare, which ends only once all of that is gone. True if it timed out."""
    if not _exited(proc.pid, timeout_s):
        init = _children(proc.pid)
        with suppress(ProcessLookupError):
            # killing unshare too would return before the namespace is empty; before its fork, it is all there is
            os.kill(init[0] if init else -proc.pid, signal.SIGKILL)
        proc.wait()
        return True
    proc.wait()
    return False


def _exited(pid: int, timeout_s: float) -> bool:
    """Whether child `pid` exits within timeout_s, noticed as it happens and left unreaped (so its pid cannot be
    reused before we kill what it started). Popen.wait(timeout) polls at intervals that double up to 50 ms,
    which made a 40 ms call return after 63."""
    exited = threading.Event()

    def wait_for_exit() -> None:
        with suppress(ChildProcessError):           # reaped already: after a timeout, by the caller's wait
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        exited.set()

    threading.Thread(target=wait_for_exit, daemon=True).start()
    return exited.wait(timeout_s)


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
