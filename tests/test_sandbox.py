"""The sandbox against hostile code, with real subprocesses: limits, isolation, cleanup, parallel calls.

Run as root (as the trainer is here): the code inside runs as uids 60000-60999, as the PythonTool calls of other
test files do (`make test` runs two files at once), so what a test finds left running is only what it started.
"""

import dataclasses
import errno
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Iterable, Iterator

import pytest

from forge_core.cgroups import join
from forge_core.rootfs import ETC_NEEDED
from forge_core.sandbox import SandboxConfig, SandboxError, _hierarchies, run_python, run_python_many

REPO = Path(__file__).resolve().parents[1]
SANDBOX_USERS = range(SandboxConfig().first_user, SandboxConfig().first_user + SandboxConfig().users)
NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="drops to other uids and checks their processes: needs root")


def processes_of(uids: Iterable[int], callers: Iterable[int] = ()) -> list[int]:
    """The processes of `uids` that this test process started, directly or through `callers`: in a cgroup of their
    calls (forge-sandbox-PID-N, which no process leaves) or of this process's delegated ones, or below this process.
    Not every process of those uids: another test process's calls run as them too."""
    marks = [f"/forge-sandbox-{pid}-" for pid in (os.getpid(), *callers)] + [f"/forge-test-delegated-{os.getpid()}/"]
    pids = []
    for name in os.listdir("/proc"):
        with suppress(FileNotFoundError, ProcessLookupError):
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid in uids and (
                    any(mark in Path(f"/proc/{name}/cgroup").read_text() for mark in marks) or below_us(int(name))):
                pids.append(int(name))
    return pids


def below_us(pid: int) -> bool:
    """Whether `pid` descends from this process (host pids, whatever PID namespace it is in)."""
    while pid > 1:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])      # its parent
        if pid == os.getpid():
            return True
    return False


def test_normal_code_returns_its_stdout():
    result = run_python("print(2 + 2)", SandboxConfig())
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("4\n", "", 0, False)
    assert result.observation() == "4\n"


def test_failures_are_reported_as_a_model_should_see_them():
    exit3, raised, segfault = run_python_many(
        ["import os; print('partial', flush=True); os._exit(3)", "raise ValueError('boom')",
         "import ctypes; ctypes.string_at(0)"], SandboxConfig())
    assert exit3.exit_code == 3 and exit3.observation() == "partial\n[exit code 3]\n"
    assert raised.exit_code == 1 and raised.observation().endswith("ValueError: boom\n")
    assert segfault.exit_code == -11 and "killed by signal 11 (Segmentation fault)" in segfault.observation()


def test_infinite_loop_times_out_and_the_call_returns():
    result = run_python("while True: pass", SandboxConfig(timeout_s=1.0))
    assert result.timed_out and result.exit_code is None
    assert 1.0 <= result.seconds < 2.0
    assert result.observation().startswith("[timed out after 1.") and result.stderr == "", "no line of unshare's"
    assert processes_of(SANDBOX_USERS) == []


def test_limits_are_set_inside():
    cfg = SandboxConfig(cpu_seconds=3, memory_mb=300, file_size_mb=2, max_processes=7, max_open_files=40)
    code = ("import resource as r\nprint([r.getrlimit(getattr(r, 'RLIMIT_' + k))[0] for k in "
            "('CPU', 'AS', 'FSIZE', 'NPROC', 'NOFILE', 'CORE', 'MEMLOCK')])")
    assert json.loads(run_python(code, cfg).stdout) == [3, 300 << 20, 2 << 20, 7, 40, 0, 0]


def test_cpu_limit_kills_busy_code_before_the_timeout():
    result = run_python("while True: pass", SandboxConfig(cpu_seconds=1, timeout_s=10.0))
    assert not result.timed_out and result.exit_code == -9
    assert result.stderr == "" and result.observation() == "[killed by signal 9 (Killed)]\n"


def test_memory_bomb_fails_inside_and_the_parent_is_untouched():
    limits_before = resource.getrlimit(resource.RLIMIT_AS)
    result = run_python("x = bytearray(2 << 30)", SandboxConfig(memory_mb=256))
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert resource.getrlimit(resource.RLIMIT_AS) == limits_before
    assert len(bytearray(300 << 20)) == 300 << 20


MEMORY_HOGS = """
import os
release_read, release = os.pipe()
children = []
for _ in range({children}):
    report_read, report = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release)
        block = b"x" * ({block_mb} << 20)         # every page touched, so charged
        os.write(report, b"1")
        os.read(release_read, 1)                  # held until the parent lets go
        os._exit(0)
    os.close(report)
    os.read(report_read, 1)                       # b"1": it holds its block; b"": it was killed
    children.append(pid)
os.close(release)
exits = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print(exits.count(0), exits.count(-9))
"""


def call_cgroups() -> list[Path]:
    """This process's calls' cgroups (another test process may run calls of its own)."""
    return [cgroup for hierarchy in _hierarchies()
            for cgroup in hierarchy.directory.glob(f"forge-sandbox-{os.getpid()}-*")]


def test_a_calls_processes_share_its_memory_16_calls_at_once():
    """RLIMIT_AS bounds each process: one call held 11 processes x 200 MB under PythonTool's 256 MB. The call's
    cgroup bounds them together: of 5 children that each take 48 MB, one after the other, at most 2 hold theirs
    at once under 120 MB (the OOM killer kills the largest), in each of 16 calls at once."""
    cfg = SandboxConfig(memory_mb=120, total_memory_mb=16 * 120, workers=16, timeout_s=20)
    results = run_python_many([MEMORY_HOGS.format(children=5, block_mb=48)] * 16, cfg)
    for result in results:
        held, killed = map(int, result.stdout.split())
        assert 1 <= held <= 2 and held + killed == 5, result.observation()
    assert call_cgroups() == [] and processes_of(SANDBOX_USERS) == []


def test_what_a_call_writes_to_its_tmp_counts_against_its_memory():
    """The call's /tmp is a tmpfs, memory that no process's RLIMIT_AS counts; the cgroup that writes it is charged,
    so a call with 100 MB of memory cannot keep 300 MB there, whatever its disk_mb and file_size_mb."""
    code = """
with open("big", "wb") as f:
    for mb in range(1, 301):
        f.write(bytes(1 << 20))
        print(mb, end=" ", flush=True)
"""
    result = run_python(code, SandboxConfig(memory_mb=100, disk_mb=400, file_size_mb=400))
    assert result.exit_code != 0 and int(result.stdout.split()[-1]) < 100, result.observation()


def test_calls_at_once_hold_at_most_the_total_memory():
    """16 calls of 200 MB each under a total of 600 MB: 3 run at once, the rest wait for a share."""
    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    cfg = SandboxConfig(memory_mb=200, total_memory_mb=600, workers=16)
    spans = [tuple(map(float, r.stdout.split())) for r in run_python_many([code] * 16, cfg)]
    at_once = max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)
    assert at_once == 3, spans
    with pytest.raises(SandboxError, match=r"^sandbox error: memory_mb 700 is more than total_memory_mb 600"):
        run_python("print(1)", dataclasses.replace(cfg, memory_mb=700))


def test_a_calls_processes_share_its_cpus():
    """3 busy processes for 1 s of wall time under a quota of 0.1 CPUs: 0.1 s of CPU between them, where RLIMIT_CPU
    alone let each have a CPU of its own (0.65 s on this 2-core machine, loaded by other jobs)."""
    code = """
import os, time
for _ in range(3):
    if os.fork() == 0:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        os._exit(0)
for _ in range(3):
    os.wait()
print(sum(os.times()[2:4]))
"""
    result = run_python(code, SandboxConfig(cpus=0.1))
    assert float(result.stdout) < 0.3, result.observation()


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def test_16_fork_bombs_at_once_are_contained_and_a_call_beside_them_runs():
    cfg = SandboxConfig(memory_mb=256, timeout_s=1.0, workers=17)
    start = time.perf_counter()
    *bombs, beside = run_python_many([FORK_BOMB] * 16 + ["print(1)"], cfg)
    assert all(b.timed_out for b in bombs) and beside.stdout == "1\n"
    assert time.perf_counter() - start < 5.0
    assert processes_of(SANDBOX_USERS) == [] and call_cgroups() == []


X86_64_SYSCALLS = {     # name: (number, arguments that make it fail harmlessly where it is allowed)
    "bpf": (321, (-1, 0, 0)), "io_uring_setup": (425, (1, 0)), "io_uring_enter": (426, (-1, 0, 0, 0, 0, 0)),
    "io_uring_register": (427, (-1, 0, 0, 0)), "userfaultfd": (323, (-1,)), "perf_event_open": (298, (0, 0, -1, -1, 0)),
    "keyctl": (250, (-1,)), "add_key": (248, (0, 0, 0, 0, 0)), "request_key": (249, (0, 0, 0, 0)),
    "ptrace": (101, (-1, 1 << 22, 0, 0)), "mount": (165, (0, 0, 0, 0, 0)), "umount2": (166, (0, 0)),
    "pivot_root": (155, (0, 0)), "fsopen": (430, (0, 0)), "fsconfig": (431, (-1, 0, 0, 0, 0)),
    "fsmount": (432, (-1, 0, 0)), "move_mount": (429, (-1, 0, -1, 0, 0)), "open_tree": (428, (-1, 0, 0)),
    "mount_setattr": (442, (-1, 0, 0, 0, 0)), "kexec_file_load": (320, (-1, -1, 0, 0, 0)),
    "init_module": (175, (0, 0, 0)), "finit_module": (313, (-1, 0, 0)), "delete_module": (176, (0, 0)),
}
SYSCALL_PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
errors = {{}}
for name, (number, arguments) in {calls!r}.items():
    ctypes.set_errno(0)
    libc.syscall(number, *arguments)
    errors[name] = ctypes.get_errno()
seccomp = [line.split()[1] for line in open("/proc/self/status") if line.startswith("Seccomp:")]
print(json.dumps([errors, seccomp]))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe's syscall numbers are x86_64's")
def test_syscalls_no_tool_needs_fail_with_eperm_16_calls_at_once():
    """Each denied syscall, with arguments that make it fail harmlessly where it is allowed (as in this root process:
    EFAULT, EBADF, EINVAL...), says EPERM in the call, where the filter is on (Seccomp: 2). kexec_load is probed only
    in the call (here its arguments could unload a loaded kernel)."""
    calls = {**X86_64_SYSCALLS, "kexec_load": (246, (0, 0, 0, 0))}
    here = json.loads(subprocess.run([sys.executable, "-c", SYSCALL_PROBE.format(calls=X86_64_SYSCALLS)],
                                     capture_output=True, text=True, check=True).stdout)[0]
    assert errno.EPERM not in here.values(), here
    cfg = SandboxConfig(memory_mb=256, workers=16)
    for result in run_python_many([SYSCALL_PROBE.format(calls=calls)] * 16, cfg):
        errors, seccomp = json.loads(result.stdout)
        assert errors == dict.fromkeys(calls, errno.EPERM) and seccomp == ["2"], result.observation()
    x32_getpid = run_python(f"import ctypes\nctypes.CDLL(None).syscall({0x40000000 | 39})\nprint('alive')", cfg)
    assert x32_getpid.exit_code == -31 and x32_getpid.stdout == "", x32_getpid.observation()      # SIGSYS


def test_only_the_files_programs_need_of_etc_are_in_sight_16_calls_at_once():
    """A container's secrets are often mounted under /etc: the call's /etc holds copies of ETC_NEEDED only. The
    interpreter and the tools PythonTool runs find all they read there (no line on stderr)."""
    from environments import PythonTool
    secret = Path(f"/etc/forge-sandbox-probe-{os.getpid()}")
    secret.write_text("token")
    secret.chmod(0o644)
    try:
        code = f"""
import collections, decimal, fractions, json, math, os, re, statistics, subprocess, time
time.localtime()
subprocess.run(["/bin/true"], check=True)
print(sorted(os.listdir("/etc")), os.path.exists({str(secret)!r}), os.path.exists("/etc/passwd"))
"""
        results = run_python_many([code] * 16, dataclasses.replace(PythonTool.sandbox, workers=16))
    finally:
        secret.unlink()
    needed = sorted(path.name for pattern in ETC_NEEDED for path in Path("/etc").glob(pattern))
    assert {(r.stdout, r.stderr) for r in results} == {(f"{needed} False False\n", "")}, results[0]


def test_the_host_name_and_cgroups_are_the_calls_own_16_calls_at_once():
    """UTS and cgroup namespaces: the call's host name is "sandbox", set in the call without the host seeing it,
    which the code may not change; its cgroups are the root of what it sees (no host path)."""
    code = """
import socket
try:
    socket.sethostname("mine")
except OSError as err:
    print(err.strerror, end=", ")
print(socket.gethostname(), {line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")})
"""
    host = socket.gethostname()
    results = run_python_many([code] * 16, SandboxConfig(memory_mb=256, workers=16))
    assert {r.stdout for r in results} == {"Operation not permitted, sandbox {'/'}\n"}, results[0].observation()
    assert socket.gethostname() == host != "sandbox"


def test_process_limit_applies_to_the_unprivileged_user():
    code = """
import os, time
forks = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        forks += 1
except OSError as err:
    print(forks, err.strerror)
"""
    result = run_python(code, SandboxConfig(max_processes=5))
    assert result.stdout == "4 Resource temporarily unavailable\n"          # 5 processes with the first
    assert processes_of(SANDBOX_USERS) == []                               # its sleeping children died with it


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.perf_counter()
    result = run_python(bomb, SandboxConfig(timeout_s=1.0))
    assert result.timed_out and time.perf_counter() - start < 2.5
    assert processes_of(SANDBOX_USERS) == []


@pytest.mark.parametrize("then", ["pass", "os.setsid()\nwhile True: time.sleep(1)"],
                         ids=["main_exits", "main_leaves_the_group_too_and_times_out"])
def test_setsid_daemon_dies_with_the_call(then):
    code = f"""
import os, time
if os.fork() == 0:
    os.setsid()                                  # out of the process group that a killpg would reach
    if os.fork() == 0:
        print("daemon started", flush=True)
        open("started", "w").close()
        time.sleep(30)
    os._exit(0)
while not os.path.exists("started"):
    time.sleep(0.01)
{then}
"""
    result = run_python(code, SandboxConfig(timeout_s=1.0))
    assert result.timed_out == (then != "pass") and result.stdout == "daemon started\n"
    assert processes_of(SANDBOX_USERS) == []     # the daemon too, at once


def test_a_call_dies_with_its_caller():
    """A rank killed with SIGKILL (kill -9, the OOM killer) takes its calls in flight with it: sleeping code does
    not live on as an orphan, holding its uid. Its calls' cgroups, which it could not remove, the next process to
    make calls removes (this test's next caller, unless another test process's first call has)."""
    def sandboxed_after(seconds: float, running: bool) -> bool:
        deadline = time.monotonic() + seconds
        while bool(processes_of(SANDBOX_USERS, [caller.pid])) != running and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(processes_of(SANDBOX_USERS, [caller.pid]))

    hierarchies = _hierarchies()        # here first, the sweep of stale cgroups is done before the caller starts
    caller = subprocess.Popen([sys.executable, "-c", "from forge_core.sandbox import SandboxConfig, run_python\n"
                               "run_python('import time\\ntime.sleep(60)', SandboxConfig(timeout_s=60))"], cwd=REPO)
    assert sandboxed_after(30, running=True), "the call did not start"
    made = [cgroup for h in hierarchies for cgroup in h.directory.glob(f"forge-sandbox-{caller.pid}-*")]
    assert len(made) == len(hierarchies)
    caller.kill()
    caller.wait()
    assert not sandboxed_after(5, running=False)
    after = subprocess.run([sys.executable, "-c", "from forge_core.sandbox import SandboxConfig, run_python\n"
                            "print(run_python('print(1)', SandboxConfig()).stdout, end='')"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert after.stdout == "1\n" and not any(cgroup.exists() for cgroup in made), after.stderr


def test_writes_outside_the_working_directory_are_refused():
    targets = [Path(f"/root/sandbox-probe-{os.getpid()}"), REPO / f"sandbox-probe-{os.getpid()}"]
    code = f"""
import os
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, "w")
    except OSError:                # PermissionError, or FileNotFoundError where the repository is under /tmp
        print("refused")
open("mine.txt", "w").write("ok")
print(os.stat(".").st_uid, os.listdir("."), os.getcwd())
"""
    result = run_python(code, SandboxConfig())
    refusals, workdir = result.stdout.splitlines()[:2], result.stdout.splitlines()[2]
    created = [t for t in targets if t.exists()]
    for target in created:
        target.unlink()
    assert refusals == ["refused", "refused"] and created == [], result.observation()
    uid, listing = workdir.split(" ", 1)
    assert int(uid) in SANDBOX_USERS and listing == "['mine.txt'] /tmp"     # its own, fresh, writable


def test_what_a_call_writes_stays_in_its_own_bounded_tmp_and_is_gone_after_it():
    """/tmp and /dev/shm are where every uid may write: each call gets a fresh tmpfs of disk_mb there, which
    neither the host nor later calls see, and which bounds its disk use."""
    shared = ["/tmp", "/dev/shm"]
    name = f"sandbox-probe-{os.getpid()}"
    write = f"for d in {shared!r}:\n    open(d + '/{name}', 'w').write('x')\nopen('big', 'wb').write(bytes(3 << 20))"
    look = f"import os\nprint([os.path.exists(d + '/{name}') for d in {shared!r}])"
    first, second = run_python(write, SandboxConfig(disk_mb=2)), run_python(look, SandboxConfig())
    assert "No space left on device" in first.stderr, first.observation()
    assert second.stdout == "[False, False]\n" and not any(Path(d, name).exists() for d in shared)


def test_only_the_system_and_the_interpreters_installation_are_in_sight():
    """The call's root holds the system directories, its interpreter's installation, /proc, /dev/null and
    /dev/urandom, and its /tmp: the repository (its data and answers, its checkpoints), home directories and
    other mounts are not there to read. What is bound is read-only, a writable mount inside it too (a tmpfs of
    mode 1777 in the interpreter's directory, whose name has a space that mountinfo escapes). The installation
    is under /tmp, as a venv in a clone there is, where the call's own /tmp is: it shows there, read-only."""
    install = Path(tempfile.mkdtemp(dir="/tmp", prefix="forge python-"))
    install.chmod(0o755)
    (install / "bin").mkdir()
    (install / "bin" / "python3").symlink_to(SandboxConfig().python)
    scratch = install / "scratch"
    scratch.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=1m", "tmpfs", str(scratch)], check=True)
    try:
        (scratch / "data.txt").write_text("shared")
        code = f"""
import os
print(sorted(os.listdir("/")), sorted(os.listdir("/dev")), os.listdir("/tmp"))
print(open({str(scratch / 'data.txt')!r}).read())
for path in ({str(REPO / 'README.md')!r}, "/root/.bashrc", "/mnt/sandboxing"):
    print(os.path.exists(path), end=" ")
for path in ({str(scratch / 'mine.txt')!r}, "/usr/mine", "/etc/mine", "/mine", "/dev/mine"):
    try:
        open(path, "w")
    except OSError as err:
        print(err.strerror, end=", ")
open("/dev/null", "w").write("x")
"""
        result = run_python(code, SandboxConfig(python=str(install / "bin" / "python3")))
        system = {name for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
                  if os.path.lexists("/" + name)}
        assert result.stdout.splitlines() == [
            f"{sorted(system | {'proc', 'dev', 'tmp'})} ['null', 'shm', 'urandom'] [{install.name!r}]",
            "shared", "False False False " + "Read-only file system, " * 5], result.observation()
        assert os.listdir(scratch) == ["data.txt"] and not Path("/usr/mine").exists()
    finally:
        subprocess.run(["umount", str(scratch)], check=True)
        shutil.rmtree(install)


def test_a_venvs_interpreter_runs_from_its_installation_and_sees_nothing_around_it():
    """This venv's interpreter (a link to a base interpreter elsewhere, pyenv's under /root here): both
    installations are bound into the call's root, so the call's uid runs it and imports from them, and the
    repository around the venv stays out of sight."""
    code = "import json, os, sys\nprint(os.getuid(), sys.prefix, end=' ')\n" \
           f"print(os.path.exists({str(REPO / 'README.md')!r}))"
    result = run_python(code, SandboxConfig(python=sys.executable))
    uid, prefix, sees_readme = result.stdout.split()
    assert int(uid) in SANDBOX_USERS and prefix == sys.prefix and sees_readme == "False", result.observation()


def test_a_fork_bomb_does_not_stop_calls_that_run_at_once():
    """Each call runs as its own uid, so RLIMIT_NPROC counts its own processes: with one uid for all, the
    interpreter of a call that started while a bomb held the budget could not start (`setpriv: failed to execute
    /usr/bin/python3: Resource temporarily unavailable`)."""
    bomb = "import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(5)\n" \
           "except OSError:\n    time.sleep(3)"
    with ThreadPoolExecutor(1) as pool:
        bombing = pool.submit(run_python, bomb, SandboxConfig(timeout_s=4.0))
        time.sleep(1.0)
        during = run_python_many(["import subprocess\nprint(subprocess.run(['/bin/true']).returncode)"] * 4,
                                 SandboxConfig())
    assert [r.observation() for r in during] == ["0\n"] * 4 and bombing.result().exit_code == 0


def shared_memory_keys(ipcs_m: str) -> list[str]:
    return [line.split()[0] for line in ipcs_m.splitlines() if line.startswith("0x")]


def test_ipc_objects_are_the_calls_own():
    """The call sees only the segment it made (ipcmk draws its key at random), and the host does not see it (other
    processes here make and remove segments of their own meanwhile)."""
    code = ("import subprocess\nsubprocess.run(['/usr/bin/ipcmk', '-M', '4096'], check=True, capture_output=True)\n"
            "print(subprocess.run(['/usr/bin/ipcs', '-m'], capture_output=True, text=True).stdout)")
    result = run_python(code, SandboxConfig())
    made = shared_memory_keys(result.stdout)
    assert len(made) == 1, result.observation()
    assert made[0] not in shared_memory_keys(subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout)


def test_a_call_cannot_reach_the_working_directory_of_another_running_at_once():
    """Calls of a turn run at once, each in /tmp as its working directory: one episode's code must not plant files
    for another's (with one shared /tmp it found the other's directory by glob and did)."""
    victim = "import os, time\ntime.sleep(2)\nprint(sorted(os.listdir('.')))"
    planter = """
import os, time
time.sleep(0.5)
for directory, _, _ in os.walk("/tmp"):             # every directory it can find there, its own /tmp included
    try:
        open(os.path.join(directory, "planted.txt"), "w").close()
    except OSError:
        pass
print(os.listdir("/tmp"))
"""
    slow, probe = run_python_many([victim, planter], SandboxConfig())
    assert (slow.stdout, probe.stdout) == ("[]\n", "['planted.txt']\n"), (slow.observation(), probe.observation())


def test_output_flood_is_truncated_and_returns_promptly():
    cfg = SandboxConfig(max_output_bytes=1000)
    result = run_python("while True: print('x' * 10000)", cfg)
    assert not result.timed_out and result.seconds < 2.0                  # RLIMIT_FSIZE (16 MB) stopped it
    assert result.stdout.startswith("x" * 1000 + "\n[output truncated: 16777216 bytes")
    assert len(result.stdout) < 1100 and "File too large" in result.stderr
    assert "[output truncated" in result.observation()


def test_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n" \
               f"except OSError as err:\n    print(err.strerror)"
        result = run_python(code, SandboxConfig())
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert result.stdout == "Network is unreachable\n"


def test_environment_is_empty():
    result = run_python("import json, os\nprint(json.dumps(dict(os.environ)))", SandboxConfig())
    environ = json.loads(result.stdout)
    assert "HOME" not in environ and "PYTHONPATH" not in environ and "PATH" not in environ
    assert set(environ) <= {"LC_CTYPE"}                # set by Python itself in the C locale (PEP 538)


def test_parallel_calls_return_in_order():
    start = time.perf_counter()
    results = run_python_many([f"import time\ntime.sleep(1)\nprint({i})" for i in range(4)], SandboxConfig())
    assert time.perf_counter() - start < 2.5
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]


def test_the_python_tool_takes_every_policy_ranks_calls_at_once():
    """Two policy ranks' `env.workers` calls at once, each as its own uid. When all calls ran as one uid with
    PythonTool's 16 processes, 108 of 200 such calls failed to start (`setpriv: failed to execute
    /usr/bin/python3: Resource temporarily unavailable`), and the SmolLM2 job's held-out accuracy read 0.475 to
    0.915 from the same weights."""
    from environments import PythonTool
    from forge_core.env import EnvConfig
    cfg = dataclasses.replace(PythonTool.sandbox, workers=2 * EnvConfig().workers)
    assert [r.observation() for r in run_python_many(["print(12)"] * 96, cfg)] == ["12\n"] * 96


def test_a_timeout_does_not_affect_the_other_calls():
    codes = ["while True: pass", "print(1)", "import time\ntime.sleep(0.3)\nprint(2)"]
    looping, first, second = run_python_many(codes, SandboxConfig(timeout_s=1.0))
    assert looping.timed_out and (first.stdout, second.stdout) == ("1\n", "2\n")
    assert not first.timed_out and not second.timed_out


UNPRIVILEGED_CALLER = """
import sys, types
sys.path.insert(0, sys.argv[1])
config = types.ModuleType("forge_core.config")      # the system python has none of our dependencies,
config.ForgeError = type("ForgeError", (Exception,), {})     # and the sandbox needs only this from config
sys.modules["forge_core.config"] = config
from forge_core.sandbox import SandboxConfig, run_python
print(run_python(sys.argv[2], SandboxConfig(max_processes=4)).stdout, end="")
"""


def test_an_unprivileged_caller_gets_a_user_namespace():
    code = """
import os, socket, time
capabilities = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff:")]
print(os.getpid(), os.getuid(), *capabilities, os.getcwd(), os.listdir("/tmp"))
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
except OSError as err:
    print(err.strerror)
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2)
except OSError as err:
    print(err.strerror)
"""
    proc = run_as_nobody(code)
    assert proc.stdout.splitlines() == ["1 0 0000000000000000 /tmp []", "Resource temporarily unavailable",
                                        "Network is unreachable"], proc.stderr     # root inside, without capabilities
    assert processes_of([NOBODY]) == []


def test_an_unprivileged_callers_own_files_are_out_of_its_calls_sight():
    """The code runs with the caller's file permissions (root of a user namespace that maps only the caller),
    so what keeps the caller's files (a checkpoint, a home directory) from it is that its root holds none of
    them: it can neither read, change nor delete them."""
    home = Path(tempfile.mkdtemp(dir="/mnt", prefix="forge-home-"))
    (home / "checkpoint.txt").write_text("step 10")
    os.chown(home, NOBODY, NOBODY)
    os.chown(home / "checkpoint.txt", NOBODY, NOBODY)
    checkpoint, new = str(home / "checkpoint.txt"), str(home / "new.txt")
    code = f"""
import os
for attempt in (lambda: open({checkpoint!r}), lambda: open({checkpoint!r}, "a"), lambda: os.remove({checkpoint!r}),
                lambda: open({new!r}, "w")):
    try:
        attempt()
    except OSError as err:
        print(err.strerror)
"""
    try:
        proc = run_as_nobody(code)
        assert proc.stdout.splitlines() == ["No such file or directory"] * 4, proc.stderr
        assert os.listdir(home) == ["checkpoint.txt"] and (home / "checkpoint.txt").read_text() == "step 10"
    finally:
        shutil.rmtree(home)


def test_a_mount_the_caller_cannot_reach_is_left_alone():
    """A mount point inside a directory only root may enter (as another user's FUSE mount is to root): an
    unprivileged caller's calls still run, where remounting it read-only would fail every call."""
    private = Path(tempfile.mkdtemp(dir="/mnt", prefix="forge-private-"))      # mode 0700, root's
    (private / "inner").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(private / "inner")], check=True)
    try:
        proc = run_as_nobody("print('ran')")
        assert proc.stdout == "ran\n", proc.stderr
    finally:
        subprocess.run(["umount", str(private / "inner")], check=True)
        shutil.rmtree(private)


def test_an_unprivileged_caller_without_a_cgroup_of_its_own_fails_in_one_line():
    """Not root and in no cgroup delegated to it, the caller cannot bound its calls' memory as a whole: no call."""
    proc = run_as_nobody("print('ran')", delegated=False)
    assert proc.stdout == "" and proc.stderr.splitlines()[-1].startswith(
        "forge_core.sandbox.SandboxError: sandbox error: cannot make a call's cgroups ([Errno 13] Permission denied"), \
        proc.stderr


def run_as_nobody(code: str, delegated: bool = True) -> subprocess.CompletedProcess:
    """run_python(code) called by an unprivileged process (uid 65534), in cgroups delegated to it or not."""
    caller = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
              SandboxConfig().python, "-I", "-c", UNPRIVILEGED_CALLER, str(REPO), code]
    with delegated_cgroups(NOBODY) if delegated else nullcontext([]) as cgroups:
        moves = join(cgroups, shutil.which("sh")) if cgroups else []
        return subprocess.run([*moves, *caller], cwd="/", capture_output=True, text=True, timeout=30)


@contextmanager
def delegated_cgroups(uid: int) -> Iterator[list[Path]]:
    """Cgroups under this process's own that `uid` may make cgroups under and move its processes into, as systemd
    delegates a user's (cgroup v1: the directory and its cgroup.procs are the user's)."""
    cgroups = [hierarchy.directory / f"forge-test-delegated-{os.getpid()}" for hierarchy in _hierarchies()]
    for cgroup in cgroups:
        cgroup.mkdir()
        for path in (cgroup, cgroup / "cgroup.procs"):
            os.chown(path, uid, uid)
    try:
        yield cgroups
    finally:
        for cgroup in cgroups:
            cgroup.rmdir()


def test_an_interpreter_that_is_not_there_fails_in_one_line():
    """Before any call runs: every call would fail, and the model would read it as its own code's failure."""
    with pytest.raises(SandboxError, match=r"^sandbox error: /nonexistent/bin/python3 cannot run in the call's root"):
        run_python("print(1)", SandboxConfig(python="/nonexistent/bin/python3"))


def test_missing_tools_fail_in_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match=r"sandbox error: '\w+' is not on PATH"):
        run_python("print(1)", SandboxConfig())
