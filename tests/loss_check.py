"""A torchrun program (2 ranks) for tests/test_grpo_math.py: one optimizer step of train_grpo.py's own
`train_on_rollout` and `attach_advantages` on FSDP shards (micro-batches of 6 and 3 sequences, a zero-variance
group dropped, NaN sampler logprobs at pad positions), for every loss type and reward scaling, against the same
step computed in one process from the loss's definition on both ranks' sequences together (an SGD step is minus
lr times the gradient; a large lr, so that the update stands far above the weights' rounding). Rank 0 prints one
JSON line: {case: the largest difference of the two updates, relative to the largest update}.

    torchrun --standalone --nproc_per_node 2 tests/loss_check.py
"""

import copy
import json

import torch

from forge_core.dist import Layout, init_roles, run_main
from forge_core.model import FSDPConfig, shard
from forge_core.moe import Routers
from forge_core.rollout import Rollout, cat_rollouts
from test_grpo_math import random_share, tiny_llama
from train_grpo import GRPOConfig, attach_advantages, group_advantages, token_logprobs, train_on_rollout, \
    zero_variance_groups

G, GROUPS, MICRO, MAX_TOKENS, LR = 3, 3, 6, 10, 1e4
CASES = [("grpo", "group"), ("bnpo", "group"), ("dr_grpo", "group"), ("dapo", "group"), ("dapo", "batch"),
         ("grpo", "batch"), ("dr_grpo", "none")]


def share(rank: int) -> Rollout:
    """A rank's 9 sequences with rewards; its first group's all equal (dropped), NaN logprobs where no token is."""
    part = random_share(rank, GROUPS, G, seed=rank)
    part.sampler_logprobs = part.sampler_logprobs.masked_fill(part.completion_mask == 0, float("nan"))
    part.rewards = torch.rand(len(part), generator=torch.Generator().manual_seed(10 + rank))
    part.rewards[:G] = 0.5
    return part


def documented_loss(model, parts: list[Rollout], loss_type: str, scale_rewards: str, cap: float) -> torch.Tensor:
    """The batch loss as each `loss_type` is defined, in one process over all ranks' sequences (bnpo: the mean
    over ranks of each rank's token mean); advantages and dropped groups over the whole batch."""
    batch = cat_rollouts(parts)
    advantages = group_advantages(batch.rewards, G, scale_rewards)
    kept = ~zero_variance_groups(batch.rewards, G)
    logp = token_logprobs(model, batch, temperature=1.0)[0]
    mask = (batch.completion_mask.bool() & kept.unsqueeze(1)).float()
    weight = torch.exp(logp.detach() - batch.sampler_logprobs.nan_to_num()).clamp(max=cap)
    per_token = -advantages.unsqueeze(1) * torch.exp(logp - logp.detach()) * weight * mask
    match loss_type:
        case "grpo":
            return (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / kept.sum()
        case "bnpo":
            n = len(parts[0])
            return sum(per_token[r * n:(r + 1) * n].sum() / mask[r * n:(r + 1) * n].sum() for r in range(2)) / 2
        case "dr_grpo":
            return per_token.sum() / (len(batch) * MAX_TOKENS)
        case "dapo":
            return per_token.sum() / mask.sum()


def full_parameters(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for p in model.parameters()]


def main() -> None:
    roles = init_roles(Layout(policy=2, reference=0, reward=0))
    parts = [share(rank) for rank in range(2)]
    results = {}
    for loss_type, scale_rewards in CASES:
        cfg = GRPOConfig()
        cfg.loss.loss_type, cfg.loss.scale_rewards, cfg.loss.drop_zero_variance_groups = loss_type, scale_rewards, True
        cfg.train.micro_batch_size, cfg.sampling.max_tokens, cfg.optim.max_grad_norm = MICRO, MAX_TOKENS, 0.0
        model = tiny_llama()
        reference = copy.deepcopy(model)
        policy = shard(model, roles.policy_mesh, FSDPConfig())
        before = full_parameters(policy)
        optim = torch.optim.SGD(policy.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
        mine = copy.deepcopy(parts[roles.rank])
        train_on_rollout(policy, optim, sched, mine, cfg, roles,
                         lambda r: attach_advantages(r, cfg.loss, G, roles.groups["policy"]), Routers(policy))
        update = [(after - b) / LR for after, b in zip(full_parameters(policy), before)]
        documented_loss(reference, copy.deepcopy(parts), loss_type, scale_rewards,
                        cfg.loss.importance_sampling_cap).backward()
        expected = [-p.grad for p in reference.parameters()]
        largest = max(e.abs().max().item() for e in expected)
        results[f"{loss_type}/{scale_rewards}"] = max((u - e).abs().max().item()
                                                      for u, e in zip(update, expected)) / largest
    if roles.rank == 0:
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    run_main(main)
