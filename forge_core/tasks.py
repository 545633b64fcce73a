"""The synthetic verifiable tasks the tiny jobs learn (tools/build_tiny.py writes them): addition (the default
job), two-digit multiplication (the calculator environment's) and a number-guessing game, and the careless
teacher's slip that `make run` and `make run-smol` imitate before GRPO unlearns it."""

import random

from .config import ForgeError

__all__ = ["addition_rows", "multiplication_rows", "guess_rows", "careless"]


def addition_rows(num_rows: int, seed: int, digits: int = 3, exclude: set[str] = frozenset(),
                  label_noise: float = 0.0) -> list[dict]:
    """`12+45=` -> `57`: distinct problems, none of them in `exclude` (keeps eval held out). With `label_noise`,
    that share of the responses (what SFT imitates) has its last digit one too high (`57` -> `58`, `59` -> `50`),
    a careless teacher's slip; `answer` (what rewards check) is always the true sum."""
    rng = random.Random(seed)
    rows = []
    for a, b, prompt in _distinct_problems(num_rows, rng, 0, 10 ** digits, "+", exclude):
        answer = str(a + b)
        response = careless(answer) if rng.random() < label_noise else answer
        rows.append({"prompt": prompt, "response": response, "answer": answer})
    return rows


def careless(answer: str) -> str:
    """The careless teacher's slip: the last digit one too high (`57` -> `58`, `59` -> `50`)."""
    return answer[:-1] + str((int(answer[-1]) + 1) % 10)


def multiplication_rows(num_rows: int, seed: int, exclude: set[str] = frozenset(), tool_share: float = 0.0
                        ) -> list[dict]:
    """`37*48=` -> `1776` (two-digit operands), the calculator environment's task. Of the responses SFT imitates,
    `tool_share` are calculator traces (`<calc>37*48</calc><result>1776</result>1776`), the rest bare answers."""
    rng = random.Random(seed)
    rows = []
    for a, b, prompt in _distinct_problems(num_rows, rng, 10, 100, "*", exclude):
        answer = str(a * b)
        trace = f"<calc>{a}*{b}</calc><result>{answer}</result>{answer}"
        rows.append({"prompt": prompt, "response": trace if rng.random() < tool_share else answer, "answer": answer})
    return rows


def guess_rows(num_games: int, seed: int, high: int = 16) -> list[dict]:
    """The number-guessing game (environments.py:GuessNumber): `answer` is the secret in [1, high]. Each game is
    also played by a random but consistent guesser (each guess uniform among the numbers the replies so far
    allow), one SFT row per guess: `prompt` the conversation so far, `response` the next guess."""
    rng = random.Random(seed)
    question = f"Guess my number between 1 and {high}."
    rows = []
    for _ in range(num_games):
        secret, low, top = rng.randint(1, high), 1, high
        talk = [{"role": "user", "content": question}]
        while True:
            guess = rng.randint(low, top)
            rows.append({"prompt": list(talk), "response": str(guess), "answer": str(secret)})
            if guess == secret:
                break
            reply = "higher" if guess < secret else "lower"
            low, top = (guess + 1, top) if reply == "higher" else (low, guess - 1)
            talk += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": reply}]
    return rows


def _distinct_problems(num_rows: int, rng: random.Random, low: int, high: int, op: str, exclude: set[str]):
    """(a, b, "a<op>b=") for distinct operand pairs in [low, high), none of whose prompts is in `exclude`."""
    if num_rows > (high - low) ** 2 - len(exclude):
        raise ForgeError(f"data error: only {(high - low) ** 2} distinct problems with operands in [{low}, {high})")
    seen = set(exclude)
    while len(seen) - len(exclude) < num_rows:
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        prompt = f"{a}{op}{b}="
        if prompt not in seen:
            seen.add(prompt)
            yield a, b, prompt
