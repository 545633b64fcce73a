"""GSM8K-style word problems with computed answers, for training a small real model without a hub.

    python tools/make_gsm8k_style.py                      # -> artifacts/gsm8k_style/{train,eval}.jsonl
    python tools/make_gsm8k_style.py --out /tmp/g --train-rows 500 --seed 1
    python tools/make_gsm8k_style.py --out artifacts/gsm8k_python --label-noise 0.7 --python-share 0.2

Rows look like GSM8K's: `question`, and `answer` = reasoning lines with calculator annotations, then
`#### N` (`Tom pays 3*4 = $<<3*4=12>>12.\n#### 12`), so `gsm8k_correct`, `math_correct` and the GSM8K
configs work on them unchanged. Five families (shopping, rates, ages, sharing, multi-step) come in a
one-step and a two/three-step form with small whole numbers: SmolLM2-135M-Instruct solves some of them
(GRPO needs groups with mixed rewards), not most. Deterministic by seed; no eval question is in train.
With `--python-share`, that share of the SFT responses computes in Python for environments.PythonTool
(`<python>x1 = 3*4\nprint(x1)</python><output>12</output>\n#### 12`), and every row's `prompt` is the
environment's first message (`make run-smol-tool`).
"""

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # environments.py is a module at the repo root
from environments import PythonTool  # noqa: E402
from forge_core.tasks import careless  # noqa: E402

NAMES = [("Tom", "he", "his"), ("Mia", "she", "her"), ("Sam", "he", "his"), ("Lena", "she", "her"),
         ("Omar", "he", "his"), ("Ava", "she", "her"), ("Ben", "he", "his"), ("Zoe", "she", "her"),
         ("Raj", "he", "his"), ("Ella", "she", "her"), ("Leo", "he", "his"), ("Nina", "she", "her")]
GOODS = ["notebooks", "pencils", "apples", "sandwiches", "tickets", "candles", "balls", "cupcakes", "books", "mugs"]
THINGS = ["cookies", "marbles", "stickers", "cards", "shells", "stamps", "beads", "toy cars"]
MOVERS = [("car", "miles", "hour"), ("train", "miles", "hour"), ("cyclist", "kilometers", "hour"),
          ("snail", "inches", "minute"), ("boat", "kilometers", "hour")]
WORKERS = [("reads", "pages", "day"), ("writes", "lines", "minute"), ("folds", "paper cranes", "hour"),
           ("bakes", "muffins", "hour"), ("plants", "flowers", "day")]


def step(text: str, expr: str, value: int, after: str = "", money: bool = False) -> str:
    """One GSM8K reasoning line: `text expr = <<expr=value>>value after` (`$` before money)."""
    dollar = "$" if money else ""
    return f"{text}{expr} = {dollar}<<{expr}={value}>>{value}{after}"


# ---- the families: each returns (question, reasoning lines, answer) ----

def shopping(rng: random.Random, hard: bool):
    (name, he, _), item = rng.choice(NAMES), rng.choice(GOODS)
    n, price = rng.randint(2, 9), rng.randint(2, 12)
    cost = n * price
    question = f"{name} buys {n} {item} that cost ${price} each."
    lines = [step(f"{name} spends ", f"{n}*{price}", cost, f" on {item}.", money=True)]
    if not hard:
        return f"{question} How much does {name} spend?", lines, cost
    bill = next(b for b in (10, 20, 50, 100, 200) if b > cost)
    lines.append(step(f"{he.capitalize()} gets back ", f"{bill}-{cost}", bill - cost, ".", money=True))
    return f"{question} {he.capitalize()} pays with a ${bill} bill. How much change does {he} get?", lines, bill - cost


def rates(rng: random.Random, hard: bool):
    if not hard:
        mover, unit, per = rng.choice(MOVERS)
        speed, t = rng.randint(2, 12) * 5, rng.randint(2, 6)
        lines = [step(f"In {t} {per}s the {mover} travels ", f"{speed}*{t}", speed * t, f" {unit}.")]
        return (f"A {mover} travels {speed} {unit} per {per}. How many {unit} does it travel in {t} {per}s?",
                lines, speed * t)
    (name, he, _), (verb, unit, per) = rng.choice(NAMES), rng.choice(WORKERS)
    rate, t = rng.randint(2, 12), rng.randint(2, 7)
    total = rate * t + rng.randint(1, 10) * 5
    done = rate * t
    lines = [step(f"In {t} {per}s {name} {verb} ", f"{rate}*{t}", done, f" {unit}."),
             step(f"{he.capitalize()} still has ", f"{total}-{done}", total - done, f" {unit} to go.")]
    return (f"{name} {verb} {rate} {unit} per {per}. {he.capitalize()} wants to finish {total} {unit}. "
            f"How many {unit} are left after {t} {per}s?", lines, total - done)


def ages(rng: random.Random, hard: bool):
    (name, he, his), relative = rng.choice(NAMES), rng.choice(["brother", "sister", "cousin"])
    age, diff = rng.randint(4, 15), rng.randint(2, 9)
    older = age + diff
    question = f"{name} is {age} years old. {his.capitalize()} {relative} is {diff} years older than {he} is."
    lines = [step(f"{name}'s {relative} is ", f"{age}+{diff}", older, " years old.")]
    if not hard:
        return f"{question} How old is {his} {relative}?", lines, older
    years = rng.randint(2, 10)
    lines.append(step(f"In {years} years the {relative} will be ", f"{older}+{years}", older + years, " years old."))
    return f"{question} How old will {his} {relative} be in {years} years?", lines, older + years


def sharing(rng: random.Random, hard: bool):
    (name, he, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    friends, each = rng.randint(2, 6), rng.randint(2, 9)
    total = friends * each
    if not hard:
        lines = [step("Each friend gets ", f"{total}/{friends}", each, f" {thing}.")]
        return (f"{name} has {total} {thing} and shares them equally among {friends} friends. "
                f"How many {thing} does each friend get?", lines, each)
    bought = rng.randint(1, total - 2)
    start = total - bought
    lines = [step(f"{name} has ", f"{start}+{bought}", total, f" {thing}."),
             step("Each friend gets ", f"{total}/{friends}", each, f" {thing}.")]
    return (f"{name} has {start} {thing} and buys {bought} more. {he.capitalize()} shares all of them equally "
            f"among {friends} friends. How many {thing} does each friend get?", lines, each)


def multi_step(rng: random.Random, hard: bool):
    (name, he, _), thing = rng.choice(NAMES), rng.choice(THINGS)
    if not hard:
        rows, per_row, extra = rng.randint(2, 8), rng.randint(3, 10), rng.randint(2, 15)
        planted = rows * per_row
        lines = [step("The farmer has ", f"{rows}*{per_row}", planted, " trees in rows."),
                 step("Now the farmer has ", f"{planted}+{extra}", planted + extra, " trees.")]
        return (f"A farmer has {rows} rows of {per_row} apple trees. He plants {extra} more trees. "
                f"How many trees does he have now?", lines, planted + extra)
    start, gave, packs, per_pack = rng.randint(15, 40), rng.randint(2, 9), rng.randint(2, 5), rng.randint(3, 8)
    left, got = start - gave, packs * per_pack
    lines = [step(f"After giving some away {name} has ", f"{start}-{gave}", left, f" {thing}."),
             step("The packs hold ", f"{packs}*{per_pack}", got, f" {thing}."),
             step(f"{name} now has ", f"{left}+{got}", left + got, f" {thing}.")]
    return (f"{name} had {start} {thing}. {he.capitalize()} gave {gave} to a friend and then bought {packs} packs "
            f"of {per_pack} {thing}. How many {thing} does {name} have now?", lines, left + got)


FAMILIES = [shopping, rates, ages, sharing, multi_step]


def python_trace(lines: list[str], answer: int) -> str:
    """The reasoning lines' calculations as a PythonTool call: one variable per line, an operand equal to an
    earlier line's value replaced by its variable (the same number either way), `/` as `//` (every division is
    exact here), then the interpreter's output and the final answer."""
    code, values = [], {}
    for i, line in enumerate(lines, 1):
        expr, value = re.search(r"<<(.+?)=(\d+)>>", line).groups()
        operands = re.split(r"([+\-*/])", expr)
        code.append(f"x{i} = " + "".join(values.get(part, part) for part in operands).replace("/", "//"))
        values[value] = f"x{i}"
    code.append(f"print(x{len(lines)})")
    return "<python>" + "\n".join(code) + f"</python><output>{answer}</output>\n#### {answer}"


def gsm8k_style_rows(num_rows: int, seed: int, hard_fraction: float = 0.5, exclude: set[str] = frozenset(),
                     label_noise: float = 0.0, python_share: float = 0.0) -> list[dict]:
    """Distinct problems (none of them in `exclude`), families in turn, `hard_fraction` of them multi-step.
    `answer` is always right; `response`, what SFT imitates, is the answer except that with `label_noise` its
    final line slips: the last digit one too high (`#### 45` -> `#### 46`), the reasoning above it intact. With
    `python_share`, that share of the responses is a PythonTool trace, which never slips."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude)
    for attempt in range(100 * num_rows):
        if len(rows) == num_rows:
            break
        family = FAMILIES[attempt % len(FAMILIES)]
        question, lines, answer = family(rng, hard=rng.random() < hard_fraction)
        if question in seen:
            continue
        seen.add(question)
        reasoning = "\n".join(lines)
        final = careless(str(answer)) if rng.random() < label_noise else str(answer)
        row = {"question": question, "answer": f"{reasoning}\n#### {answer}",
               "response": f"{reasoning}\n#### {final}", "family": family.__name__}
        if python_share and rng.random() < python_share:
            row["response"] = python_trace(lines, answer)
        rows.append(row)
    assert len(rows) == num_rows, f"only {len(rows)} distinct problems for seed {seed}"
    return rows


@dataclass
class MakeConfig:
    out: Path = Path("artifacts/gsm8k_style")
    train_rows: int = 2000
    eval_rows: int = 500
    hard_fraction: float = 0.5          # share of two/three-step problems
    label_noise: float = 0.0            # share of train responses whose final answer slips (a careless teacher)
    python_share: float = 0.0           # share of train responses that compute in Python (environments.PythonTool)
    seed: int = 0


def main(cfg: MakeConfig) -> None:
    eval_rows = gsm8k_style_rows(cfg.eval_rows, cfg.seed + 1, cfg.hard_fraction)
    train_rows = gsm8k_style_rows(cfg.train_rows, cfg.seed, cfg.hard_fraction,
                                  exclude={r["question"] for r in eval_rows}, label_noise=cfg.label_noise,
                                  python_share=cfg.python_share)
    if cfg.python_share:            # SFT's prompts are what the environment's episodes start with
        for row in eval_rows + train_rows:
            row["prompt"] = PythonTool().reset(row)
    cfg.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        (cfg.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {cfg.out}/train.jsonl ({len(train_rows)} rows) and eval.jsonl ({len(eval_rows)} rows)")


if __name__ == "__main__":
    main(tyro.cli(MakeConfig))
