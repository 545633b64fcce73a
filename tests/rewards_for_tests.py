"""User-written reward functions, loaded by path (`rewards.functions: ["tests/rewards_for_tests.py:NAME"]`)."""


def digit_fraction(completion: str, row: dict) -> float:
    """Dense and easy to learn from a random model: the share of characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def flaky(completion: str, row: dict) -> float:
    """Raises on every other prompt: the run must go on, score 0 and count the errors."""
    if int(row["answer"]) % 2:
        raise ValueError("a bug in a user's reward function")
    return 1.0


# ---- hostile reward functions: each must cost only its own calls (scored 0, counted), never the run ----

def sleeps_forever(completion: str, row: dict) -> float:
    import time
    time.sleep(10**6)
    return 1.0


def exits(completion: str, row: dict) -> float:
    import os
    os._exit(3)


def segfaults(completion: str, row: dict) -> float:
    import ctypes
    return float(ctypes.string_at(0)[0])


def eats_memory(completion: str, row: dict) -> float:
    return float(len(bytearray(16 << 30)))


def returns_nan(completion: str, row: dict) -> float:
    return float("nan")


def returns_inf(completion: str, row: dict) -> float:
    return float("-inf")


def returns_string(completion: str, row: dict) -> str:
    return "1.0"


def returns_none(completion: str, row: dict) -> None:
    return None


def sleeps_on_odd(completion: str, row: dict) -> float:
    """The row's "i", after sleeping forever on odd ones: a verifier that hangs on some inputs."""
    import time
    if row["i"] % 2:
        time.sleep(10**6)
    return float(row["i"])


def value_of(completion: str, row: dict) -> float:
    return float(row["i"])


def overflows_on_marked_rows(completion: str, row: dict) -> float:
    """Finite, but so large on rows marked "overflow" that their group's advantages are not: a NaN loss."""
    return 3e38 if row.get("overflow") else digit_fraction(completion, row)
