"""Run untrusted code (a model's Python tool calls) isolated and limited, and leave nothing it started running
after the call. Users' reward functions run in worker processes on terms of their own (forge_core/scoring.py).

    results = run_python_many(["print(2 + 2)", "while True: pass"], SandboxConfig(timeout_s=2))
    [r.observation() for r in results]          # ['4\n', '[timed out after 2.0s]\n']

Each call (`run_isolated`) runs in cgroups of its own as `unshare --pid --fork --kill-child --mount-proc --net --ipc
--uts --cgroup -- sh -c MOUNTS -- python ENTER -- prlimit ... -- setpriv ... -- ARGV` in a session of its own
(`start_new_session`), with an empty environment, stdin from a file and stdout/stderr to unlinked files
(RLIMIT_FSIZE bounds them; the first `max_output_bytes` of each are read back). MOUNTS builds a new root and chroots
into it: a read-only tmpfs holding the system directories (/usr, /lib...), the interpreter's own installation (a
venv and the interpreter it links to), /proc, /dev/null and /dev/urandom, all bound read-only, a copy of the few
files of /etc that programs read (`ETC_NEEDED`; not the rest of /etc, where a container's secrets are often
mounted), and a tmpfs of `disk_mb` on /tmp and /dev/shm, the working directory: everything the code writes is
there, counts against `disk_mb` (then "No space left on device") and `memory_mb`, and is gone with the call's mount
namespace. The caller's files, the job's data (its answers too) and every other mount are not in the call's root at
all. ENTER (`cfg.python -I -S`, still privileged) names the host "sandbox", loads the call's seccomp filter and
cds to /tmp. What holds:
- As root: PID (with its own /proc), network (a loopback that is down: "Network is unreachable"), IPC, UTS and
  cgroup namespaces, and the code runs with no supplementary groups and no_new_privs as a uid/gid of its own:
  one of `first_user` .. `first_user + users - 1` that no other call on this machine runs as while it runs (an
  flock on a file in a root-only directory holds it; a call waits while all are taken). So file permissions
  apply, RLIMIT_NPROC counts this call's processes only, and calls that run at once share nothing.
- Not root: the same namespaces inside a user namespace that maps only the caller, as its root
  (`unshare --user --map-root-user`), which builds the root and then runs the code with no capabilities (an
  empty bounding set): uid 0 inside, the caller's file permissions on what the root holds, all of it read-only.
  Needs unprivileged user namespaces and a cgroup delegated to the caller, else `SandboxError` at the first call.
- Either way, a call is bounded as a whole by cgroups of its own (v1 or v2, whichever holds each controller), made
  under the caller's own (whose limits hold over them too), which the call's first process joins before it starts
  anything: its processes, pipes, memfds and /tmp (a tmpfs is charged to the cgroup that writes it) share
  `memory_mb` (beyond it the kernel's OOM killer kills the call's largest process), its processes and threads are
  at most `max_processes` (pids.max), and it runs on at most `cpus` CPUs at once (a CPU quota: its CPU time is at
  most cpus x timeout_s). Where no such cgroup can be made, `SandboxError` at the first call, never a call without
  them. After the call whatever is left in them is killed and they are removed.
- Calls of one process at once: each holds its `memory_mb` of `total_memory_mb` while it runs, and one that does
  not fit waits to start. Held shares, not one parent cgroup with memory.max at the total: at a shared limit the
  OOM killer kills the largest process of any call, so one call's allocations could kill another's code, where
  held shares leave each call's outcome to its own code. The host's bound is ranks x total_memory_mb.
- A seccomp filter makes the syscalls that no tool needs fail with EPERM (`DENIED_SYSCALLS`: bpf, io_uring,
  userfaultfd, perf_event_open, the kernel keyring, ptrace, mounts, kexec, kernel modules) and kills a process that
  makes another architecture's syscalls (x32, int 0x80); RLIMIT_MEMLOCK is 0.
- When the code's first process ends, or when the call times out and we kill it, the kernel
  kills every process left in its PID namespace, daemons that left the process group with setsid() included.
  That first process is the namespace's init (pid 1), so signals it sends itself without a handler are ignored.
  When the calling process is killed, its calls in flight die with it (PR_SET_PDEATHSIG at both ends).
Not covered: the code reads what its uid may read in the system directories; where the machine allows
unprivileged user namespaces, it may make its own (the filter and the cgroups hold in them too).
"""

import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cache
from itertools import count, repeat
from pathlib import Path
from typing import BinaryIO, Iterator

from .config import ForgeError

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "run_isolated", "run_python", "run_python_many",
           "exit_status"]


_UNSHARE_SIGKILL_BUG = b"unshare: sigprocmask unblock failed: Invalid argument\n"


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
    with _MEMORY.held(cfg.memory_mb, cfg.total_memory_mb), _own_user(cfg) as uid, \
            _call_cgroups(cfg, _hierarchies()) as cgroups, tempfile.TemporaryFile() as input_file, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        command = [*_dies_with_caller(), *_join(cgroups), *_namespaces(),
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


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")   # what programs run from
ETC_NEEDED = ("ld.so.cache", "localtime", "python3*")    # what of /etc they read: the loader's cache, the time zone,
                                                         # Debian's Python configuration (its sitecustomize)
DEVICES = ("/dev/null", "/dev/urandom")
NEW_ROOT = "/sys"       # where the root is built, hiding /sys in this mount namespace: no program is installed
                        # there, where /tmp may hold one (a venv in a clone under /tmp)


def _private_root(disk_mb: int, uid: int | None, python: str, program: str) -> list[str]:
    """Inside the namespaces, still privileged there: a new root that holds only what programs need to run (the
    system directories, the program's and the interpreter's installations, /proc, a few devices), bound
    read-only, and a copy of ETC_NEEDED; a tmpfs of disk_mb, owned by the code's uid, on its /tmp and /dev/shm;
    then chroot into it and run the rest of the command through ENTER. The caller's files, the job's data and
    every other mount are out of sight."""
    mount, owner, sh = _tool("mount"), f",uid={uid},gid={uid}" if uid is not None else "", _tool("sh")
    shown = list(dict.fromkeys([*(top for top in SYSTEM_DIRS if os.path.lexists(top)), *_installation(python),
                                *_installation(program)]))
    links, dirs = [top for top in shown if os.path.islink(top)], [top for top in shown if not os.path.islink(top)]
    etc = sorted(str(path) for pattern in ETC_NEEDED for path in Path("/etc").glob(pattern))
    devices = [device for device in DEVICES if os.path.exists(device)]
    steps = [["umask", "022"], [mount, "-t", "tmpfs", "-o", "size=1m,mode=0755,nosuid,nodev", "tmpfs", NEW_ROOT],
             [_tool("mkdir"), "-p", *(NEW_ROOT + d for d in ("/proc", "/dev/shm", "/tmp", "/etc"))],
             *([[_tool("cp"), "-RP", "--preserve=mode", *etc, NEW_ROOT + "/etc"]] if etc else []),
             [mount, "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0700,nosuid,nodev{owner}", "tmpfs", NEW_ROOT + "/tmp"],
             [mount, "--bind", NEW_ROOT + "/tmp", NEW_ROOT + "/dev/shm"],
             [_tool("mkdir"), "-p", *(NEW_ROOT + d for d in dirs)],      # after /tmp: an installation may be in it
             *([[_tool("cp"), "-P", *links, NEW_ROOT]] if links else []),
             *([mount, "--rbind", d, NEW_ROOT + d] for d in dirs),
             *([mount, "-o", f"remount,bind,{options}", NEW_ROOT + point] for point, options in _read_only(dirs)),
             [_tool("touch"), *(NEW_ROOT + device for device in devices)],
             *([mount, "--bind", device, NEW_ROOT + device] for device in devices),
             [mount, "--rbind", "/proc", NEW_ROOT + "/proc"],
             [mount, "-o", "remount,bind,ro,nosuid,nodev", NEW_ROOT],
             ["exec", _tool("chroot"), NEW_ROOT, python, "-I", "-S", "-c", ENTER, _syscall_filter()]]
    return [sh, "-c", " && ".join(shlex.join(step) for step in steps) + ' "$@"', "sh"]


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


def _installation(program: str) -> list[str]:
    """The directories a program outside the system directories runs from: the prefix above its bin/ (a venv's,
    with pyvenv.cfg) and, where it is a link, the prefix of the file it links to (the venv's base interpreter)."""
    prefixes = {str(Path(program).parent.resolve().parent), str(Path(program).resolve().parent.parent)}
    system = [os.path.realpath(top) for top in SYSTEM_DIRS]
    outside = sorted(p for p in prefixes if not any(Path(p).is_relative_to(top) for top in system))
    if "/" in outside:
        raise SandboxError(f"sandbox error: {program} is not installed under a directory of its own")
    return outside


def _read_only(dirs: list[str]) -> list[tuple[str, str]]:
    """What to remount read-only in the new root, where `dirs` are bound with the mounts under them: each of
    `dirs` (its binding has the flags of the mount that holds it) and each mount under one, with the flags of
    its own (nosuid, noexec, atime, ...) kept, as a user namespace may not clear them. Autofs triggers (looking
    would mount them) and mount points this process cannot reach (another user's FUSE mount: the code, with no
    more rights than this process, cannot reach it either) are left alone. Read afresh at every call."""
    mounts = _mounts()
    under = [point for point in mounts if any(Path(point).is_relative_to(d) for d in dirs) and os.path.exists(point)]
    holders = {point: max((m for m in mounts if Path(point).is_relative_to(m)), key=len) for point in (*dirs, *under)}
    return [(point, _read_only_options(mounts[m])) for point, m in holders.items() if "rw" in mounts[m]]


def _mounts() -> dict[str, list[str]]:
    """Mount points and their options (the top one where several are stacked), autofs triggers left out."""
    return {point: options for _, point, fstype, options, _ in _mountinfo() if fstype != "autofs"}


def _mountinfo() -> Iterator[tuple[str, str, str, list[str], list[str]]]:
    """Each mount's root in its filesystem, mount point, type, options, and its filesystem's own options."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, (fstype, _, super_options) = line.split(), line.split(" - ")[1].split()
            yield (_unescape(fields[3]), _unescape(fields[4]), fstype, fields[5].split(","),
                   super_options.split(","))


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _read_only_options(options: list[str]) -> str:
    return ",".join("ro" if option == "rw" else option for option in options)


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
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")   # chroot: sbin, not on every PATH
    if path is None:
        raise SandboxError(f"sandbox error: '{name}' is not on PATH (util-linux and coreutils are needed)")
    return path


# ---- cgroups: each call's memory, processes and CPU as a whole, and the memory of the calls at once ----

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_SWAP_LIMITS = ("memory.memsw.limit_in_bytes", "memory.swap.max")      # there only where swap is accounted
_CALL_NUMBERS = count()


@dataclass(frozen=True)
class _Hierarchy:
    directory: Path                     # this process's cgroup in it: its calls' cgroups are made under it
    version: int                        # 1 or 2
    controllers: tuple[str, ...]        # those of CONTROLLERS that it holds


@dataclass
class _MemoryBudget:
    """The memory_mb that this process's calls in flight hold."""
    held_mb: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    @contextmanager
    def held(self, memory_mb: int, total_mb: int) -> Iterator[None]:
        if memory_mb > total_mb:
            raise SandboxError(f"sandbox error: memory_mb {memory_mb} is more than total_memory_mb {total_mb}, "
                               "so the call could never start")
        with self.changed:
            self.changed.wait_for(lambda: self.held_mb + memory_mb <= total_mb)
            self.held_mb += memory_mb
        try:
            yield
        finally:
            with self.changed:
                self.held_mb -= memory_mb
                self.changed.notify_all()


_MEMORY = _MemoryBudget()


@cache
def _hierarchies() -> tuple[_Hierarchy, ...]:
    """Where this process's calls get their cgroups, tried once (a call's cgroups made, joined and removed):
    else one line, never a call that runs unbounded."""
    try:
        hierarchies = _find_hierarchies()
        _remove_stale(hierarchies)
        with _call_cgroups(SandboxConfig(), hierarchies) as cgroups:
            joined = subprocess.run([*_join(cgroups), _tool("true")], capture_output=True, text=True)
        problem = joined.stderr.strip() if joined.returncode else ""
    except OSError as err:
        problem = str(err)
    if problem:
        raise SandboxError(f"sandbox error: cannot make a call's cgroups ({problem}), without which its memory, "
                           f"processes and CPU are unbounded; run as root or in a cgroup delegated to uid "
                           f"{os.geteuid()}")
    return hierarchies


def _find_hierarchies() -> tuple[_Hierarchy, ...]:
    """This process's cgroup in each hierarchy that holds some of CONTROLLERS: in v1 each controller has one (some
    share it), in v2 one holds them all, where this process's cgroup must enable them for its children."""
    own = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))   # controllers: path
    found, held = [], set()
    for root, point, fstype, _, options in _mountinfo():
        version = {"cgroup": 1, "cgroup2": 2}.get(fstype)
        # v1: the hierarchy's line in /proc/self/cgroup names its controllers, as the mount's options do; v2's, none
        names = next((n for n in own if n and set(n.split(",")) <= set(options)), None) if version == 1 else ""
        path = own.get(names) if version else None
        if path is None or not Path(path).is_relative_to(root):
            continue
        directory = Path(point, Path(path).relative_to(root))
        offered = names.split(",") if version == 1 else (directory / "cgroup.controllers").read_text().split()
        if controllers := tuple(c for c in CONTROLLERS if c in offered and c not in held):
            if version == 2:
                (directory / "cgroup.subtree_control").write_text(" ".join("+" + c for c in controllers))
            found.append(_Hierarchy(directory, version, controllers))
            held.update(controllers)
    if missing := [c for c in CONTROLLERS if c not in held]:
        raise OSError(f"no cgroup hierarchy holds {', '.join(missing)}")
    return tuple(found)


def _remove_stale(hierarchies: tuple[_Hierarchy, ...]) -> None:
    """Remove the call cgroups of processes that are gone: one killed in a call could not."""
    for hierarchy in hierarchies:
        for directory in hierarchy.directory.glob("forge-sandbox-*"):
            if not Path("/proc", directory.name.split("-")[2]).exists():
                with suppress(OSError):
                    _remove_cgroup(directory)


@contextmanager
def _call_cgroups(cfg: SandboxConfig, hierarchies: tuple[_Hierarchy, ...]) -> Iterator[list[Path]]:
    """The call's cgroup in each hierarchy, limited as cfg says: yields them for the call's first process to join.
    Then whatever is left in them is killed, and they are removed."""
    name = f"forge-sandbox-{os.getpid()}-{next(_CALL_NUMBERS)}"
    made = []
    try:
        for hierarchy in hierarchies:
            directory = hierarchy.directory / name
            directory.mkdir()
            made.append(directory)
            for file, value in _cgroup_limits(cfg, hierarchy):
                if file not in _SWAP_LIMITS or (directory / file).exists():
                    (directory / file).write_text(value)
        yield made
    finally:
        for directory in made:
            _remove_cgroup(directory)


def _cgroup_limits(cfg: SandboxConfig, hierarchy: _Hierarchy) -> list[tuple[str, str]]:
    memory, quota_us = str(cfg.memory_mb << 20), round(cfg.cpus * CPU_PERIOD_US)
    files = {1: {"memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
                 "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota_us))]},
             2: {"memory": [("memory.max", memory), ("memory.swap.max", "0")],
                 "cpu": [("cpu.max", f"{quota_us} {CPU_PERIOD_US}")]}}[hierarchy.version]
    files["pids"] = [("pids.max", str(cfg.max_processes + 1))]     # and unshare, outside the PID namespace
    return [limit for controller in hierarchy.controllers for limit in files[controller]]


def _join(cgroups: list[Path]) -> list[str]:
    # the call's first process moves itself into its cgroups before it starts anything, so all it starts is in them
    moves = " && ".join(f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))}" for cgroup in cgroups)
    return [_tool("sh"), "-c", moves + ' && exec "$@"', "sh"]


def _remove_cgroup(directory: Path) -> None:
    """Kill what is left in a call's cgroup until none is left (v1 has no cgroup.kill: the same loop serves v2; a
    killed process forks no more, and leaves cgroup.procs as it exits), then remove it."""
    while pids := (directory / "cgroup.procs").read_text().split():
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.001)
    directory.rmdir()


# ---- the seccomp filter ----

DENIED_SYSCALLS = ("bpf", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
                   "keyctl", "add_key", "request_key", "ptrace", "mount", "umount2", "pivot_root", "fsopen",
                   "fsconfig", "fsmount", "move_mount", "open_tree", "mount_setattr", "kexec_load", "kexec_file_load",
                   "init_module", "finit_module", "delete_module")
_SCMP_ACT_ALLOW, _SCMP_ACT_KILL_PROCESS, _SCMP_ACT_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | errno.EPERM
_SCMP_FLTATR_ACT_BADARCH, _NR_SCMP_ERROR = 2, -1


@cache
def _syscall_filter() -> str:
    """The seccomp filter, a BPF program in hex, that ENTER loads: DENIED_SYSCALLS fail with EPERM, and another
    architecture's syscalls kill the process. libseccomp (Debian's libseccomp2, which apt needs) knows each
    architecture's numbers."""
    library = ctypes.util.find_library("seccomp")
    if library is None:
        raise SandboxError("sandbox error: libseccomp is not installed (Debian: apt-get install libseccomp2)")
    seccomp = ctypes.CDLL(library)
    seccomp.seccomp_init.restype = ctypes.c_void_p
    context = ctypes.c_void_p(seccomp.seccomp_init(ctypes.c_uint32(_SCMP_ACT_ALLOW)))
    try:
        seccomp.seccomp_attr_set(context, _SCMP_FLTATR_ACT_BADARCH, ctypes.c_uint32(_SCMP_ACT_KILL_PROCESS))
        for name in DENIED_SYSCALLS:
            number = seccomp.seccomp_syscall_resolve_name(name.encode())
            if number == _NR_SCMP_ERROR or seccomp.seccomp_rule_add(context, ctypes.c_uint32(_SCMP_ACT_EPERM),
                                                                    number, 0) < 0:
                raise SandboxError(f"sandbox error: libseccomp cannot deny the syscall {name}")
        with tempfile.TemporaryFile() as program:
            if seccomp.seccomp_export_bpf(context, program.fileno()) < 0:
                raise SandboxError("sandbox error: libseccomp cannot build the seccomp filter")
            program.seek(0)
            return program.read().hex()
    finally:
        seccomp.seccomp_release(context)


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
