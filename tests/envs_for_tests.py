"""User-written environments, loaded by path (`env.name: "tests/envs_for_tests.py:NAME"`)."""


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


class NoStep:
    def reset(self, row: dict) -> str:
        return row["prompt"]
