"""Processes that user code starts, found and ended: the descendants of a process (read from /proc, zombies
included), killed until none is left, and the child-subreaper flag that keeps them below it (an orphan, a daemon
that left its session with setsid(), comes to the nearest subreaper above it instead of init). Reward workers
(forge_core/scoring.py) and environment calls (forge_core/env.py) end what they started with these."""

import ctypes
import os
import signal
import time
from contextlib import contextmanager, suppress

__all__ = ["become_subreaper", "subreaping", "descendants", "kill_descendants", "reap_children",
           "end_descendants_but"]

_PR_SET_CHILD_SUBREAPER = 36            # prctl(2): orphans below this process come to it, not to init


def become_subreaper() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)


@contextmanager
def subreaping():
    """A subreaper while inside only: orphans that come to this process later would stay its zombies, as no one
    here waits for them."""
    become_subreaper()
    try:
        yield
    finally:
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 0)


def kill_descendants(pid: int, spared: frozenset[int] = frozenset()) -> None:
    """SIGKILL every living descendant of `pid` but the `spared` until none is left: what one forks meanwhile,
    the next round finds."""
    while living := [p for p in descendants(pid) if p not in spared and _alive(p)]:
        for descendant in living:
            with suppress(ProcessLookupError):
                os.kill(descendant, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    found, parents = [], [pid]
    while parents:
        children = _children(parents.pop())
        found += children
        parents += children
    return found


def _children(pid: int) -> list[int]:
    """The processes that `pid`'s threads started, zombies included; none once it is gone."""
    children = []
    with suppress(FileNotFoundError, ProcessLookupError):
        for thread in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{thread}/children") as f:
                children += [int(child) for child in f.read().split()]
    return children


def _alive(pid: int) -> bool:
    with suppress(FileNotFoundError, ProcessLookupError), open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")       # not a zombie, nor dead
    return False


def end_descendants_but(spared: frozenset[int]) -> None:
    """Kill this process's descendants but the `spared`, and collect those of them that were its children (only
    those: a child that another thread started and waits for is not taken from it)."""
    me = os.getpid()
    kill_descendants(me, spared)
    killed = [pid for pid in _children(me) if pid not in spared]
    deadline = time.monotonic() + 1.0           # SIGKILL takes a moment to leave a zombie
    while killed and time.monotonic() < deadline:
        for pid in list(killed):
            with suppress(ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    continue
            killed.remove(pid)
        time.sleep(0.01 if killed else 0)


def reap_children() -> None:
    with suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
