"""Reward functions: each is one plain Python function `(completion: str, row: dict) -> float`.

`row` is the data set row the prompt came from (its answer field included). Name functions in the config:

    rewards:
      functions: [addition_correct, "my_rewards.py:brevity"]   # from this file, and one of your own
      weights: [1.0, 0.1]
    # or a module's: "mypkg.scoring:judge"

Functions run in worker processes (`rewards.workers`, forge_core/scoring.py): one that raises or returns no finite
number scores 0 for that sample and is counted in `reward/errors`; one that runs past `rewards.timeout_s` or kills
its process scores 0 and is counted in `reward/timeouts` or `reward/errors`. The run continues.
"""

import logging
import re

__all__ = ["addition_correct", "gsm8k_correct", "math_correct", "extract_gsm8k_answer"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def addition_correct(completion: str, row: dict) -> float:
    """1 if the completion is exactly the sum (the synthetic task's answer), else 0."""
    return float(completion.strip() == str(row["answer"]).strip())


def extract_gsm8k_answer(text: str) -> str | None:
    """GSM8K's gold format ends with `#### 42`; a model's answer is the number after ####, in \\boxed{},
    or else its last number. Commas and a trailing `.0` are normalised away."""
    for pattern in (r"####\s*(-?[\d,\.]+)", r"\\boxed\{([^}]*)\}", r"<answer>(.*?)</answer>"):
        found = re.findall(pattern, text, flags=re.S)
        if found:
            text = found[-1]
            break
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def gsm8k_correct(completion: str, row: dict) -> float:
    """1 if the completion's final number equals the gold answer (GSM8K `#### N` format), else 0."""
    gold = extract_gsm8k_answer(str(row["answer"]))
    return float(gold is not None and extract_gsm8k_answer(completion) == gold)


def _math_correct(completion: str, row: dict) -> float:
    """`math_correct`: symbolic equivalence with math-verify (pip install math-verify); exact GSM8K match
    without it."""
    if _math_verify is None:
        return gsm8k_correct(completion, row)
    parse, verify = _math_verify
    answer = re.sub(r"</?answer>", "", completion)
    gold = str(row["answer"]).split("####")[-1]
    # math-verify's own timeout is a signal, which cannot stop a long C call (`9**9**9**9`); rewards.timeout_s
    # bounds the call instead, by killing its worker
    return float(verify(parse(gold), parse(answer), timeout_seconds=None))


_math_verify = None      # (parse, verify), once math_correct is looked up and math-verify is installed


def __getattr__(name: str):
    """`rewards.math_correct`, imported on first use: math-verify (sympy) takes ~1 s of CPU to import, which
    every process that loads this file (each rank, each reward worker) paid when no config named it. A reward
    worker looks its functions up as it starts, so the import stays out of calls timed by rewards.timeout_s."""
    global _math_verify
    if name != "math_correct":
        raise AttributeError(f"module 'rewards' has no attribute '{name}'")
    try:
        from math_verify import parse, verify
        _math_verify = parse, verify
    except ImportError:
        pass
    # math_correct turns math-verify's signal timeout off (see there), and it warns once per process about that
    logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    return _math_correct

