"""Held-out accuracy of the policy's engines (single-turn answers or episodes): greedy, and G samples per prompt at the
training temperature, each engine a share of the rows; a run's before -> after line.
"""

import math
from typing import Callable

from .dist import Roles, set_phase
from .metrics import reduce_metrics
from .rollout import engine_share

__all__ = ["evaluate", "describe_accuracy"]


def evaluate(sample: Callable, tokenizer, eval_rows: list[dict], roles: Roles, tp: int,
             accuracy: Callable[[list[str], list[dict]], list[float]] | None, sampled: bool) -> dict[str, float]:
    """Held-out accuracy of greedy decoding, and (`sampled`) of G samples per prompt at the training
    temperature: the reward GRPO maximises, which can rise while the most likely answer (greedy) stays. Each
    engine takes its share of the rows, and each of its `tp` ranks counts a share of those. Episodes count as
    solved or not (`accuracy` None), with tool use, turns, and tool errors and timeouts per episode (a sandbox
    that cannot start calls shows there)."""
    set_phase("eval")
    engine, place = divmod(roles.policy_ranks.index(roles.rank), tp)
    index = list(range(engine, len(eval_rows), len(roles.policy_ranks) // tp))
    out = {}
    for suffix, greedy in (("", True), ("_sampled", False))[:1 + sampled]:
        rollout = engine_share(sample(index, seed=0, greedy=greedy), len(index), place, tp)
        if rollout.episode:         # an episode is solved when its return is positive
            sums = {"accuracy": (rollout.episode["return"] > 0).sum().item(),
                    "tool_use": (rollout.episode["tool_calls"] > 0).sum().item(),
                    "turns": rollout.episode["turns"].sum().item(),
                    **{k: rollout.episode[k].sum().item() for k in ("tool_errors", "tool_timeouts")}}
        else:
            texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            sums = {"accuracy": sum(accuracy(texts, [eval_rows[i] for i in rollout.row_ids]))}
        s = reduce_metrics(sums | {"n": len(rollout)}, roles.groups["policy"])
        out |= {f"eval/{k}{suffix}": v / s["n"] for k, v in s.items() if k != "n"}
    return out


def describe_accuracy(start: dict[str, float], end: dict[str, float], temperature: float, G: int, steps: range,
                      rows: int, tools: bool) -> str:
    """Greedy accuracy with its standard error over `rows` held-out rows (the larger of start's and end's:
    a rise of more than twice it is more than noise), then sampled accuracy (`G` samples at `temperature`) when it
    was measured; for episodes, their turns, and tool use where the environment has tools (`stop` strings)."""
    stderr = max(math.sqrt(p * (1 - p) / rows) for p in (start["eval/accuracy"], end["eval/accuracy"]))
    sampled = "" if "eval/accuracy_sampled" not in start else (
        f", sampled (T={temperature:g}, {G} per prompt) "
        f"{start['eval/accuracy_sampled']:.3f} -> {end['eval/accuracy_sampled']:.3f}")
    line = (f"held-out accuracy: greedy {start['eval/accuracy']:.3f} -> {end['eval/accuracy']:.3f} "
            f"({rows} rows, s.e. {stderr:.3f}){sampled} (step {steps.start} -> {steps.stop})")
    if "eval/turns" in start:
        tool_use = (f"tool use: {start['eval/tool_use']:.2f} -> {end['eval/tool_use']:.2f} of episodes, "
                    if tools else "")
        line += f"\n{tool_use}turns per episode {start['eval/turns']:.2f} -> {end['eval/turns']:.2f} (held-out, greedy)"
    return line
