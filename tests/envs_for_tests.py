"""User-written environments, loaded by path (`env.name: "tests/envs_for_tests.py:NAME"`)."""

import os
import random
import subprocess
import sys
import time


class Chatter:
    """Answers every model turn, so a random model's episodes have observations of both kinds: a turn that ends
    at the stop string "1" gets an inline reply, one that ends at EOS gets a new user message. Reward: the share
    of digits in the turn (dense, learnable from a random model). Raises on a turn that has a "7" in it."""
    stop = ["1"]

    def reset(self, row: dict) -> str:
        self.replies = []
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        if "7" in action:
            raise ValueError("a bug in a user's environment")
        self.replies.append(f"<{len(action)}>")
        return self.replies[-1], sum(c.isdigit() for c in action) / max(len(action), 1), False


class Dice:
    """Answers each model turn with a random number and reward, as an environment may (a tool's timing, a game's
    draw), counts one tool error per episode, and names its messages' role when it starts."""
    stop = ["1"]

    def reset(self, row: dict) -> str:
        self.tool_errors = 1
        self.observation_role = "dice"
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        draw = random.SystemRandom()            # not Python's seeded stream, which vLLM seeds alike on every rank
        return str(draw.randrange(1000)), draw.random(), False


class NoStep:
    def reset(self, row: dict) -> str:
        return row["prompt"]


class StopAtST:
    """Its stop string, `st`, falls inside tokens of the tiny tokenizer (`sta`, `start`, `assistant`), as SmolLM2's
    `</python>` ends inside `><`; keeps every action it sees."""
    stop = ["st"]
    actions: list[str] = []         # every instance's, in order

    def reset(self, row: dict) -> str:
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        StopAtST.actions.append(action)
        return "ok", 0.0, False


class Unreliable:
    """Fails as user code can, by row (`n+n=`): reset raises for n % 4 == 1, step never returns for n % 4 == 2
    and returns a NaN reward for n % 4 == 3; the other episodes end at once with reward 1."""

    def reset(self, row: dict) -> str:
        self.n = int(row["prompt"].split("+")[0])
        if self.n % 4 == 1:
            raise KeyError("question")
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.n % 4 == 2:
            time.sleep(3600)
        return "", float("nan") if self.n % 4 == 3 else 1.0, True


class Liar:
    """Answers with the wrong types, by row (`n+n=`): a first message that is not a string (n % 4 == 0), an
    observation that is a list (1), the reward "1", a string (2), and the `done` "yes" (3)."""

    def reset(self, row: dict):
        self.n = int(row["prompt"].split("+")[0])
        return 12345 if self.n % 4 == 0 else row["prompt"]

    def step(self, action: str):
        return [(["obs"], 1.0, False), ("ok", "1", True), ("ok", 1.0, "yes")][self.n % 4 - 1]


class LongWinded:
    """A first message longer than the tiny model's 128-token context for even rows (`n+n=`)."""

    def reset(self, row: dict) -> str:
        return row["prompt"] * 100 if int(row["prompt"].split("+")[0]) % 2 == 0 else row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", 1.0, True


class Spawner:
    """Starts what outlives a process group: a child in a session of its own, in `reset`, and a daemon (double
    fork, setsid) in `step`; both sleep STRAY_SECONDS, a number no other process here sleeps."""
    STRAY_SECONDS = "1017.25"

    def reset(self, row: dict) -> str:
        subprocess.Popen(["sleep", self.STRAY_SECONDS], start_new_session=True)
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", self.STRAY_SECONDS])
            os._exit(0)
        return "", 1.0, True


class Hangs:
    """Every step hangs."""

    def reset(self, row: dict) -> str:
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(3600)
        return "", 0.0, True


class Exits:
    """Ends the program, as a user's script might: `reset` calls sys.exit(3)."""

    def reset(self, row: dict) -> str:
        sys.exit(3)

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", 0.0, True



class Tortoise:
    """Chatter's answers, each naming its episode's row, some at once and some 0.2 s later (by the row and turn), so
    that continuous episodes' turns come back out of the order they were asked in."""
    stop = ["1"]

    def reset(self, row: dict) -> str:
        self.row, self.turn = row["prompt"], 0
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turn += 1
        time.sleep(0.2 if (len(self.row) + self.turn) % 3 == 0 else 0.0)
        return f"<{self.row[:2]}{len(action)}>", sum(c.isdigit() for c in action) / max(len(action), 1), False
