"""Scoring GSM8K-style completions with `math_correct` (math-verify): in the reward rank's own process, one call
after another (how train_grpo.py scored before reward functions ran isolated), against the FunctionPool that
train_grpo.py uses now (forge_core/scoring.py) with 1 and 2 worker processes.

    python bench/bench_rewards.py                    # about a minute on 2 CPU cores
    python bench/bench_rewards.py --completions 512 --function addition_correct   # the default job's reward

Rows from tools/make_gsm8k_style.py; for each, completions of the shapes a model writes (the gold answer after
`####`, in \\boxed{}, in <answer> tags, a wrong number, chatter ending in a number), cycled. Every contender
scores the same passes, in turn pass by pass: one untimed (the workers' first calls), then --repeats timed ones,
each on rows of another seed (a model never writes the same completions twice; math-verify caches); figures are
medians. Every pool must give the inline scores exactly. Target: the pool with `rewards.workers` (2) scores
faster than inline.
"""
import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from make_gsm8k_style import gsm8k_style_rows  # noqa: E402

import rewards  # noqa: E402
from forge_core.scoring import FunctionPool  # noqa: E402

SHAPES = ("Step by step, the total is {a}.\n#### {a}", "So the answer is \\boxed{{{a}}}.", "<answer>{a}</answer>",
          "I think it is {w}.\n#### {w}", "First {w} then {a} and finally {w}, that is the count")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--completions", type=int, default=1024, help="calls per pass (a GRPO step's worth or more)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--function", default="math_correct", help="a rewards.py function")
    return p.parse_args(argv)


def completions(n: int, seed: int) -> tuple[list[str], list[dict]]:
    rows = gsm8k_style_rows(max(n // len(SHAPES), 1), seed=seed)
    texts, used = [], []
    for i in range(n):
        row = rows[i % len(rows)]
        gold = int(row["answer"].split("####")[-1])
        texts.append(SHAPES[i % len(SHAPES)].format(a=gold, w=gold + 1 + i % 7))
        used.append(row)
    return texts, used


def pool_scores(pool: FunctionPool, texts: list[str], rows: list[dict]) -> list[float]:
    return [o.value for o in pool.map([(0, (t, r)) for t, r in zip(texts, rows)], deadline_s=600)]


def main(args: argparse.Namespace) -> None:
    passes = [completions(args.completions, seed) for seed in range(args.repeats + 1)]
    fn = getattr(rewards, args.function)
    with ExitStack() as stack:
        pools = {w: stack.enter_context(FunctionPool([args.function], str(REPO / "rewards.py"), "rewards.functions", workers=w))
                 for w in args.workers}
        contenders = {"inline": lambda texts, rows: [fn(t, r) for t, r in zip(texts, rows)]} | \
            {f"pool_{w}": partial(pool_scores, pool) for w, pool in pools.items()}
        seconds, values = {name: [] for name in contenders}, {name: [] for name in contenders}
        for i, (texts, rows) in enumerate(passes):
            for name, score in contenders.items():     # in turn, pass by pass: the machine's drift hits all alike
                t0 = time.perf_counter()
                values[name].append(score(texts, rows))
                seconds[name].append(time.perf_counter() - t0)
    for name in contenders:
        assert values[name] == values["inline"], f"{name} scored differently from inline"
    results = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    inline_s = results["inline"]
    n = args.completions
    mean = statistics.mean(v for scores in values["inline"] for v in scores)
    print(f"scoring {n} GSM8K-style completions with {args.function} (mean score {mean:.2f}), median of "
          f"{args.repeats} passes")
    print("| scoring | seconds | calls/s | vs inline |\n|---|---|---|---|")
    labels = {"inline": "inline, one call after another (before)"} | \
        {f"pool_{w}": f"FunctionPool, {w} worker{'s' * (w > 1)}" for w in args.workers}
    for name, median_s in results.items():
        print(f"| {labels[name]} | {median_s:.3f} | {n / median_s:.0f} | {inline_s / median_s:.2f}x |")
    print(f"raw numbers: {json.dumps({'completions': n, 'seconds': results})}")


if __name__ == "__main__":
    main(parse_args())
