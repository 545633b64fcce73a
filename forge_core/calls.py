"""User code called from threads and bounded in time: a pool whose hung calls are left behind.

Environment and game steps are user code: a call can hang, and Python cannot stop a thread. `CallPool` runs calls
on `workers` threads, started once and kept while the pool lives (starting a thread per call cost a turn of 256
instant calls about 20 ms, a pool's thread 2 ms). A call not back `timeout_s` after it started answers None and
its thread is left behind; a new thread takes its place, so calls queued behind hung ones still run. A call still
waiting `2 * timeout_s` after it was asked for is not run (None): however many calls hang, they cost a bounded
time. Answers come back as they finish (`answers`), so a caller can act on each at once.
"""

import threading
import time
from collections import deque
from typing import Callable, Hashable

__all__ = ["CallPool"]


class CallPool:
    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        lock = threading.Lock()                 # guards what follows
        self.work = threading.Condition(lock)   # notified when a call is asked for (one idle thread wakes) or at close
        self.changed = threading.Condition(lock)    # notified when a call starts or ends: `answers` waits on it
        self.waiting: deque = deque()           # (key, call, args, asked at)
        self.running: dict[int, tuple[Hashable, float]] = {}    # call number -> (key, started at)
        self.done: list[tuple[Hashable, object]] = []
        self.threads = 0                        # threads not left behind
        self.numbered, self.late, self.closed = 0, 0, False
        self.busy_s, self.busy_since = 0.0, 0.0     # wall seconds with a call running

    def ask(self, key: Hashable, call: Callable, *args, asked: float | None = None) -> None:
        """Run `call(*args)`; its result comes back from `answers` as (key, result). `asked`: the time (monotonic) its
        wait counts from, when that is before now (a batch's start: none of its calls can have started before)."""
        with self.changed:
            self.waiting.append((key, call, args, time.monotonic() if asked is None else asked))
            self._grow()
            self.work.notify()

    def pending(self) -> bool:
        with self.changed:
            return bool(self.waiting or self.running or self.done)

    def answers(self, wait: bool) -> list[tuple[Hashable, object]]:
        """(key, result or None) for each call done or given up on since the last time; with `wait`, at least one
        unless none is pending."""
        with self.changed:
            while True:
                timeout = self._give_up()
                if self.done or not wait or not (self.running or self.waiting):
                    break
                self.changed.wait(timeout)
            out, self.done = self.done, []
        return out

    def idle(self) -> bool:
        with self.changed:
            return not (self.running or self.waiting)

    def close(self) -> None:
        """Ends the threads that wait for work (hung ones end when their call does)."""
        with self.changed:
            self.closed = True
            self.work.notify_all()

    def _grow(self) -> None:
        while self.threads < min(self.workers, len(self.running) + len(self.waiting)):
            self.threads += 1
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while (task := self._next()) is not None:
            number, key, call, args = task
            result = call(*args)
            with self.changed:
                if self.running.pop(number, None) is None:      # given up on: a new thread took this one's place
                    return
                self._count_busy()
                self.done.append((key, result))
                self.changed.notify_all()

    def _next(self):
        with self.changed:
            while not self.waiting and not self.closed:
                self.work.wait()
            if self.closed:
                self.threads -= 1
                return None
            key, call, args, _ = self.waiting.popleft()
            self.numbered += 1
            if not self.running:
                self.busy_since = time.monotonic()
            self.running[self.numbered] = (key, time.monotonic())
            self.changed.notify_all()       # a new deadline for `answers`
            return self.numbered, key, call, args

    def _count_busy(self) -> None:
        if not self.running:
            self.busy_s += time.monotonic() - self.busy_since

    def _give_up(self) -> float:
        """Calls past their time answer None; the seconds until the next one would be."""
        now = time.monotonic()
        for number in [n for n, (_, started) in self.running.items() if now - started >= self.timeout_s]:
            key, _ = self.running.pop(number)
            self.threads -= 1
            self.late += 1
            self.done.append((key, None))
            self._count_busy()
        while self.waiting and now - self.waiting[0][3] >= 2 * self.timeout_s:
            self.late += 1
            self.done.append((self.waiting.popleft()[0], None))
        self._grow()
        deadlines = [started + self.timeout_s for _, started in self.running.values()]
        deadlines += [asked + 2 * self.timeout_s for *_, asked in self.waiting]
        return max(0.0, min(deadlines, default=now + 1.0) - now)
