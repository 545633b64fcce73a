"""Run untrusted code (a model's Python tool calls) isolated and limited, and leave nothing it started running
after the call. Users' reward functions run in worker processes on the same terms (forge_core/scoring.py).

    results = run_python_many(["print(2 + 2)", "while True: pass"], SandboxConfig(timeout_s=2))
    [r.observation() for r in results]          # ['4\n', '[timed out after 2.0s]\n']

Each call (`run_isolated`) runs as `unshare --pid --fork --kill-child --mount-proc --net --ipc -- sh -c MOUNTS --
prlimit ... -- setpriv ... -- ARGV` in a session of its own (`start_new_session`), with an empty environment, stdin
from a file and stdout/stderr to unlinked files (RLIMIT_FSIZE bounds them; the first `max_output_bytes` of each are
read back). MOUNTS makes every host mount read-only but /proc and /sys (device nodes still take writes: /dev/null
works), puts a tmpfs of `disk_mb` on /tmp, mounts the same one on /var/tmp, /dev/shm and /run/lock, and makes /tmp
the working directory: everything the code writes there is its own, counts against `disk_mb` (then "No space left
on device"), and is gone with the call's mount namespace. What holds:
- As root: a PID namespace with its own /proc, a network namespace (a loopback that is down: "Network is
  unreachable"), an IPC namespace, and the code runs with no supplementary groups and no_new_privs as a uid/gid
  of its own: one of `first_user` .. `first_user + users - 1` that no other call on this machine runs as while it
  runs (an flock on a file in a root-only directory holds it; a call waits while all are taken). So file
  permissions apply, RLIMIT_NPROC counts this call's processes only, and calls that run at once share nothing.
- Not root: the same namespaces inside a user namespace that maps only the caller, as its root
  (`unshare --user --map-root-user`), which mounts the tmpfs and then runs the code with no capabilities (an
  empty bounding set): uid 0 inside, the caller's file permissions outside, on read-only mounts: it reads the
  caller's files but cannot change or delete them. Needs unprivileged user namespaces, else `SandboxError` at
  the first call. RLIMIT_NPROC counts per call.
- Either way: when the code's first process ends, or when the call times out and we kill it, the kernel
  kills every process left in its PID namespace, daemons that left the process group with setsid() included.
  That first process is the namespace's init (pid 1), so signals it sends itself without a handler are ignored.
  When the calling process is killed, its calls in flight die with it (PR_SET_PDEATHSIG at both ends).
Not covered: the code reads what its uid may read (a non-root caller's files too; with no network, what it reads
goes only into its output); the tmpfs is memory, outside RLIMIT_AS.
"""

import fcntl
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from itertools import repeat
from pathlib import Path
from typing import BinaryIO, Iterator

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
    disk_mb: int = 64                   # the call's /tmp (a tmpfs, in memory): all it may write
    max_processes: int = 16             # RLIMIT_NPROC: the call's processes
    max_open_files: int = 64            # RLIMIT_NOFILE
    max_output_bytes: int = 4096        # kept of stdout, and of stderr
    workers: int = 8                    # calls that run_python_many runs at once
    python: str = "/usr/bin/python3"    # must be executable by any user: a venv under /root is not
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
    with _own_user(cfg) as uid, tempfile.TemporaryFile() as input_file, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:
        command = [*_dies_with_caller(), *_namespaces(), *_private_tmp(cfg.disk_mb, uid), *_limits(cfg),
                   *_drop_privileges(uid), *argv]
        input_file.write(stdin)
        input_file.seek(0)
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd="/", env={}, stdin=input_file, stdout=out, stderr=err,
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


# ---- the command: namespaces, a private /tmp, then limits, then the unprivileged user ----

@cache
def _namespaces() -> tuple[str, ...]:
    """`unshare` into new PID (own /proc), mount, network and IPC namespaces, tried once with the private /tmp:
    fail loudly, never run bare."""
    user_namespace = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    command = (_tool("unshare"), *user_namespace, "--pid", "--fork", "--kill-child", "--mount-proc", "--net",
               "--ipc", "--")
    probe = subprocess.run([*command, *_private_tmp(1, None), _tool("true")], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"sandbox error: cannot create namespaces as uid {os.geteuid()} "
                           f"({probe.stderr.strip()}); run as root or allow unprivileged user namespaces")
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        raise SandboxError("sandbox error: this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    return command


SHARED_WRITABLE = ("/var/tmp", "/dev/shm", "/run/lock")     # besides /tmp, where every user may write


def _private_tmp(disk_mb: int, uid: int | None) -> list[str]:
    """Inside the namespaces, still privileged there: every host mount the code could write to read-only; then a
    tmpfs on /tmp, on the other shared writable directories and as the working directory, owned by the code's
    uid; then the rest of the command."""
    mount, owner = _tool("mount"), f",uid={uid},gid={uid}" if uid is not None else ""
    read_only = [f"{mount} -o remount,bind,{options} {shlex.quote(point)}" for point, options in _writable_mounts()]
    steps = [*read_only, f"{mount} -t tmpfs -o size={disk_mb}m,mode=0700,nosuid,nodev{owner} tmpfs /tmp",
             *(f"{mount} --bind /tmp {path}" for path in SHARED_WRITABLE if os.path.isdir(path)),
             "cd /tmp", "unset OLDPWD PWD", 'exec "$@"']
    return [_tool("sh"), "-c", " && ".join(steps), "sh"]


def _writable_mounts() -> list[tuple[str, str]]:
    """The host's writable mount points, each with the read-only options to remount it with: its own flags
    (nosuid, noexec, atime, ...) kept, as a user namespace may not clear them. /proc and /sys are left alone,
    and so are the directories the private /tmp covers, autofs triggers (touching one would mount it) and mount
    points this process cannot reach (another user's FUSE mount: remounting it would fail, and the code, with
    no more rights than this process, cannot reach it either). Read afresh at every call, as mounts come and go."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, fstype = line.split(), line.split(" - ")[1].split()[0]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            options = fields[5].split(",")
            if "rw" in options and fstype != "autofs" and point not in ("/tmp", *SHARED_WRITABLE) and \
                    not any(point == top or point.startswith(top + "/") for top in ("/proc", "/sys")) and \
                    os.path.exists(point):
                mounts[point] = ",".join("ro" if option == "rw" else option for option in options)
    return list(mounts.items())


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
            f"--nofile={cfg.max_open_files}", "--core=0", "--"]


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
