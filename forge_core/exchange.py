"""The two exchanges of a GRPO step between the policy ranks and the scoring (reward and reference) ranks:
token ids out (exchange 1: `send_rollout` / `serve`), scores back (exchange 2: `serve` / `receive_scores`). Each
is one all-gather of Python objects over the `scoring` group; a rank with nothing to say sends None.
"""

from typing import Callable

import torch
from torch import Tensor

from .dist import Roles, exchange, set_phase
from .rollout import Rollout, pad_cat

__all__ = ["serve", "merge_rollouts", "send_rollout", "receive_scores"]


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
    """Exchange 1, policy side: token ids out to the reward and reference ranks (None: nothing new)."""
    exchange(None if rollout is None else
             {"prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask, "row_ids": rollout.row_ids,
              "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask},
             roles.groups["scoring"])


def receive_scores(rollout: Rollout | None, roles: Roles, local_rewards: Callable[[Rollout], dict],
                   with_reference: bool) -> None:
    """Exchange 2, policy side: rewards (and, `with_reference`, reference logprobs) for `rollout` come back and
    are attached; without reward ranks `local_rewards(rollout)` scores it here. An episode's return is added to
    its rewards (the `env` term)."""
    answers = exchange(None, roles.groups["scoring"])
    if rollout is None:
        return
    n = len(rollout)
    offset = roles.policy_ranks.index(roles.rank) * n         # every policy rank has the same count
    if not roles.reward_ranks:        # no reward ranks: rule rewards run right here
        answers.append({"index": list(range(offset, offset + n)), **local_rewards(rollout)})
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
