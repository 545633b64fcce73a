"""User-written reward functions, loaded by path (`rewards.functions: ["tests/rewards_for_tests.py:NAME"]`)."""


def digit_fraction(completion: str, row: dict) -> float:
    """Dense and easy to learn from a random model: the share of characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def flaky(completion: str, row: dict) -> float:
    """Raises on every other prompt: the run must go on, score 0 and count the errors."""
    if int(row["answer"]) % 2:
        raise ValueError("a bug in a user's reward function")
    return 1.0
