"""Cgroups that bound a sandboxed call (forge_core/sandbox.py) as a whole, and the memory of the calls at once.

Each call gets a cgroup of its own in each hierarchy that holds one of CONTROLLERS (v1 or v2, whichever holds each),
made under this process's own, whose limits hold over them too. The call's first process joins them before it
starts anything (`join`), so all it starts is in them, and no process leaves them. Its processes, pipes, memfds and
/tmp (a tmpfs is charged to the cgroup that writes it) share `memory_mb` (beyond it the kernel's OOM killer kills the
call's largest process), its processes and threads are at most `processes` (pids.max), and it runs on at most
`cpus` CPUs at once (a CPU quota). After the call whatever is left in them is killed and they are removed; those of
a process that was killed in a call, the next process to look for hierarchies removes.

The calls of one process at once each hold their memory_mb of a total while they run (`MemoryBudget`), and one that
does not fit waits to start. Held shares, not one parent cgroup with memory.max at the total: at a shared limit the
OOM killer kills the largest process of any call, so one call's allocations could kill another's code, where held
shares leave each call's outcome to its own code.

    hierarchies = find_hierarchies()
    with call_cgroups(hierarchies, memory_mb=512, processes=17, cpus=1.0) as cgroups:
        subprocess.run([*join(cgroups, "/bin/sh"), *command])
"""

import os
import shlex
import signal
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Iterator

from .rootfs import mountinfo

__all__ = ["CONTROLLERS", "Hierarchy", "MemoryBudget", "find_hierarchies", "remove_stale", "call_cgroups", "join"]

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
_SWAP_LIMITS = ("memory.memsw.limit_in_bytes", "memory.swap.max")      # there only where swap is accounted
_PREFIX = "forge-sandbox-"                                              # then this process's pid and a number
_CALL_NUMBERS = count()


@dataclass(frozen=True)
class Hierarchy:
    directory: Path                     # this process's cgroup in it: its calls' cgroups are made under it
    version: int                        # 1 or 2
    controllers: tuple[str, ...]        # those of CONTROLLERS that it holds


@dataclass
class MemoryBudget:
    """The memory_mb that this process's calls in flight hold."""
    held_mb: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    @contextmanager
    def held(self, memory_mb: int, total_mb: int) -> Iterator[None]:
        assert memory_mb <= total_mb, f"a share of {memory_mb} MB never fits in {total_mb} MB"
        with self.changed:
            self.changed.wait_for(lambda: self.held_mb + memory_mb <= total_mb)
            self.held_mb += memory_mb
        try:
            yield
        finally:
            with self.changed:
                self.held_mb -= memory_mb
                self.changed.notify_all()


def find_hierarchies() -> tuple[Hierarchy, ...]:
    """This process's cgroup in each hierarchy that holds some of CONTROLLERS: in v1 each controller has one (some
    share it), in v2 one holds them all, where this process's cgroup must enable them for its children. OSError
    where some controller has none."""
    own = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))   # controllers: path
    found, held = [], set()
    for root, point, fstype, _, options in mountinfo():
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
            found.append(Hierarchy(directory, version, controllers))
            held.update(controllers)
    if missing := [c for c in CONTROLLERS if c not in held]:
        raise OSError(f"no cgroup hierarchy holds {', '.join(missing)}")
    return tuple(found)


def remove_stale(hierarchies: tuple[Hierarchy, ...]) -> None:
    """Remove the call cgroups of processes that are gone: one killed in a call could not."""
    for hierarchy in hierarchies:
        for directory in hierarchy.directory.glob(_PREFIX + "*"):
            if not Path("/proc", directory.name.removeprefix(_PREFIX).split("-")[0]).exists():
                with suppress(OSError):
                    _remove_cgroup(directory)


@contextmanager
def call_cgroups(hierarchies: tuple[Hierarchy, ...], memory_mb: int, processes: int,
                 cpus: float) -> Iterator[list[Path]]:
    """The call's cgroup in each hierarchy, limited to memory_mb, `processes` and `cpus`: yields them for the call's
    first process to join. Then whatever is left in them is killed, and they are removed."""
    name = f"{_PREFIX}{os.getpid()}-{next(_CALL_NUMBERS)}"
    made = []
    try:
        for hierarchy in hierarchies:
            directory = hierarchy.directory / name
            directory.mkdir()
            made.append(directory)
            for file, value in _limits(hierarchy, memory_mb, processes, cpus):
                if file not in _SWAP_LIMITS or (directory / file).exists():
                    (directory / file).write_text(value)
        yield made
    finally:
        for directory in made:
            _remove_cgroup(directory)


def _limits(hierarchy: Hierarchy, memory_mb: int, processes: int, cpus: float) -> list[tuple[str, str]]:
    memory, quota_us = str(memory_mb << 20), round(cpus * CPU_PERIOD_US)
    files = {1: {"memory": [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
                 "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US)), ("cpu.cfs_quota_us", str(quota_us))]},
             2: {"memory": [("memory.max", memory), ("memory.swap.max", "0")],
                 "cpu": [("cpu.max", f"{quota_us} {CPU_PERIOD_US}")]}}[hierarchy.version]
    files["pids"] = [("pids.max", str(processes))]
    return [limit for controller in hierarchy.controllers for limit in files[controller]]


def join(cgroups: list[Path], sh: str) -> list[str]:
    """A command prefix whose process moves itself into `cgroups` and then runs the rest, so all it starts is in
    them."""
    moves = " && ".join(f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))}" for cgroup in cgroups)
    return [sh, "-c", moves + ' && exec "$@"', "sh"]


def _remove_cgroup(directory: Path) -> None:
    """Kill what is left in a call's cgroup until none is left (v1 has no cgroup.kill: the same loop serves v2; a
    killed process forks no more, and leaves cgroup.procs as it exits), then remove it."""
    while pids := (directory / "cgroup.procs").read_text().split():
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.001)
    directory.rmdir()
