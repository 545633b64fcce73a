"""The two exchanges of a GRPO step between the policy ranks and the scoring (reward and reference) ranks:
token ids out (exchange 1: `send_rollout` / `serve`), scores back (exchange 2: `serve` / `receive_scores`), and what
the scoring ranks answer. Each is one all-gather of Python objects over the `scoring` group; a rank with nothing to
say sends None.
"""

import math
from typing import Callable

import torch
from torch import Tensor

from .dist import Roles, exchange, set_phase
from .rollout import Rollout, pad_cat
from .scoring import score

__all__ = ["serve", "reward_answerer", "reference_answerer", "merge_rollouts", "send_rollout", "receive_scores"]


def serve(answer: Callable[[dict], dict], steps: range, one_step_off: bool, roles: Roles) -> None:
    """Reference and reward ranks, once per step of `steps`: token ids in (exchange 1), `answer(batch)` out
    (exchange 2). One step off, the answer sent at step t is the one computed for step t-1 while the policy
    trained."""
    group = roles.groups["scoring"]
    ready = None
    set_phase("score")                  # between the exchanges
    for _ in range(len(steps) + one_step_off):
        gathered = exchange(None, group)
        batch = merge_rollouts(gathered) if any(p is not None for p in gathered) else None
        if one_step_off:
            exchange(ready, group)
            ready = answer(batch) if batch is not None else None
        else:
            exchange(answer(batch), group)


def reward_answerer(roles: Roles, tokenizer, rows: list[dict], pool, cfg, reward_model=None) -> Callable[[dict], dict]:
    """Reward ranks score their share of all sequences (i % R) with the reward functions in `pool` (`cfg`: the
    reward config) and the optional reward model."""
    me, R = roles.reward_ranks.index(roles.rank), len(roles.reward_ranks)

    def answer(batch: dict) -> dict:
        mine = list(range(me, len(batch["row_ids"]), R))
        texts = tokenizer.batch_decode(batch["completion_ids"][mine], skip_special_tokens=True)
        s = score(texts, [rows[batch["row_ids"][i]] for i in mine], pool, cfg)
        if reward_model is not None:
            s["rewards"] = [t + cfg.model_weight * m for t, m in zip(s["rewards"], reward_model(batch, mine))]
        return {"index": mine, **s}
    return answer


def reference_answerer(roles: Roles, logprobs: Callable[[Rollout], Tensor]) -> Callable[[dict], dict]:
    """Reference ranks: `logprobs` (the frozen policy's, FSDP over the reference group) of their chunk of all
    sequences, a tensor-parallel block's ranks the same chunk; chunks are padded to equal length so every rank
    runs the same number of forwards."""
    mesh = roles.reference_mesh
    tp = mesh["tp"].size() if mesh.ndim == 2 else 1
    me, R = roles.reference_ranks.index(roles.rank) // tp, len(roles.reference_ranks) // tp

    def answer(batch: dict) -> dict:
        n = len(batch["row_ids"])
        per_rank = math.ceil(n / R)
        mine = [min(i, n - 1) for i in range(me * per_rank, (me + 1) * per_rank)]
        part = Rollout(batch["prompt_ids"][mine], batch["prompt_mask"][mine], batch["completion_ids"][mine],
                       batch["completion_mask"][mine], None, None, [batch["row_ids"][i] for i in mine])
        with torch.no_grad():
            ref = logprobs(part)
        keep = [k for k, i in enumerate(mine) if i == me * per_rank + k]
        return {"index": [mine[k] for k in keep], "ref_logprobs": ref[keep].cpu()}
    return answer


def merge_rollouts(gathered: list) -> dict:
    """The policy ranks' payloads (others sent None), concatenated in rank order = the global sequence index;
    prompts left-padded and completions right-padded to the widest rank's."""
    parts = [p for p in gathered if p is not None]

    def cat(key: str, left: bool) -> Tensor:
        return pad_cat([p[key] for p in parts], left)
    return {"prompt_ids": cat("prompt_ids", True), "prompt_mask": cat("prompt_mask", True),
            "completion_ids": cat("completion_ids", False), "completion_mask": cat("completion_mask", False),
            "row_ids": [r for p in parts for r in p["row_ids"]]}


def send_rollout(rollout: Rollout | None, roles: Roles) -> None:
    """Exchange 1, policy side: token ids out to the reward and reference ranks (None: nothing new; a
    tensor-parallel block's rollout goes once, from its first rank)."""
    exchange(None if rollout is None or not roles.speaks_for_block else
             {"prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask, "row_ids": rollout.row_ids,
              "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask},
             roles.groups["scoring"])


def receive_scores(rollout: Rollout | None, roles: Roles, local_rewards: Callable[[Rollout], dict],
                   with_reference: bool) -> None:
    """Exchange 2, policy side: rewards (and, `with_reference`, reference logprobs) for `rollout` come back and
    are attached; without reward ranks `local_rewards(rollout)` scores it here, on the first rank of a
    tensor-parallel block, which sends the scores to the rest of the block (a timeout on one rank alone would
    give the block's ranks different losses for the same weights). An episode's return is added to its
    rewards (the `env` term)."""
    n = 0 if rollout is None else len(rollout)
    offset = roles.data_rank * n                     # every block has the same count
    local = None
    if rollout is not None and not roles.reward_ranks and roles.speaks_for_block:   # rule rewards right here
        local = {"index": list(range(offset, offset + n)), **local_rewards(rollout)}
    answers = exchange(local, roles.groups["scoring"])
    if rollout is None:
        return
    rewards, errors, timeouts, terms = torch.zeros(n), torch.zeros(n), torch.zeros(n), {}
    ref = torch.zeros_like(rollout.sampler_logprobs)
    for answer in filter(None, answers):
        index = torch.tensor(answer["index"], dtype=torch.long) - offset
        mine = (index >= 0) & (index < n)
        at = index[mine]
        if "rewards" in answer:
            rewards[at] = torch.tensor(answer["rewards"], dtype=torch.float32)[mine]
            errors[at] = torch.tensor(answer["errors"], dtype=torch.float32)[mine]
            timeouts[at] = torch.tensor(answer["timeouts"], dtype=torch.float32)[mine]
            for name, values in answer["terms"].items():
                terms.setdefault(name, torch.zeros(n))[at] = torch.tensor(values, dtype=torch.float32)[mine]
        else:
            ref[at] = answer["ref_logprobs"][mine][:, :ref.shape[1]]     # the merged batch may be wider
    if rollout.episode:               # the environment's return, summed over the episode's steps
        rewards, terms = rewards + rollout.episode["return"], terms | {"env": rollout.episode["return"]}
    rollout.rewards, rollout.reward_terms = rewards, terms
    rollout.reward_errors, rollout.reward_timeouts = errors, timeouts
    rollout.ref_logprobs = ref if with_reference else None
