"""The GRPO loss pieces against values computed by hand."""

import json
import math

import pytest
import torch
from torch import Tensor

import forge_core.logprobs
from forge_core.rollout import Rollout, balanced_share, pad_left, pad_right, shared_prompt_rows
from train_grpo import (LossConfig, LossScale, group_advantages, grpo_loss, kl_penalty, loss_scale, token_logprobs,
                        zero_variance_groups)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()          # unbiased, as TRL: 0.5
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, 4, "group")[:4], expected)
    torch.testing.assert_close(group_advantages(rewards, 4, "group")[4:], torch.zeros(4))
    torch.testing.assert_close(group_advantages(rewards, 4, "none"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    batch_std = rewards.std().item()
    torch.testing.assert_close(group_advantages(rewards, 4, "batch")[0], torch.tensor(0.75 / (batch_std + 1e-4)))
    assert zero_variance_groups(rewards, 4).tolist() == [False] * 4 + [True] * 4


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])        # log(ref/pi) = -0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def _rollout(adv, old, sampler, mask, ref=None) -> Rollout:
    n, c = mask.shape
    return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.zeros(n, c, dtype=torch.long), mask, sampler, torch.zeros(n, dtype=torch.bool), [0] * n,
                   ref_logprobs=ref, advantages=adv, old_logprobs=old)


def test_clipped_surrogate_and_aggregations_by_hand():
    # two sequences: 2 tokens and 1 token; ratios e^{0.5} (clipped for A>0) and e^{-0.5} (clipped for A<0)
    logp = torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    mb = _rollout(torch.tensor([1.0, -1.0]), old, old.clone(), mask)
    cfg = LossConfig(epsilon=0.2, importance_sampling_cap=0)
    # per token: seq0: -min(e^.5 * 1, 1.2 * 1) = -1.2 ; -min(1, 1) = -1 ; seq1: -min(-e^-.5, 0.8 * -1) = 0.8
    t = [-1.2, -1.0, 0.8]
    by_type = {"grpo": ((t[0] + t[1]) / 2 + t[2]) / 2, "bnpo": sum(t) / 3, "dr_grpo": sum(t) / (2 * 2),
               "dapo": sum(t) / 3}
    for loss_type, expected in by_type.items():
        cfg.loss_type = loss_type
        loss, stats = grpo_loss(logp, mb, cfg, loss_scale(mb, 2, None, 1))
        assert loss.item() == pytest.approx(expected, abs=1e-6), loss_type
        assert stats["clipped"] == 2          # seq0 token0 (ratio above 1.2, A>0) and seq1 (below 0.8, A<0)
    cfg.epsilon_high = 0.28                   # clip-higher: e^0.5 = 1.65 still above 1.28
    loss, _ = grpo_loss(logp, mb, cfg, loss_scale(mb, 2, None, 1))
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 0.8) / 3, abs=1e-6)


def test_importance_weight_is_truncated_and_kl_is_added():
    logp = torch.zeros(1, 1)
    sampler = torch.tensor([[-2.0]])          # exp(0 - (-2)) = 7.39, truncated to the cap 3
    mb = _rollout(torch.tensor([1.0]), None, sampler, torch.ones(1, 1, dtype=torch.long), ref=torch.tensor([[-0.5]]))
    cfg = LossConfig(importance_sampling_cap=3.0, beta=0.1, kl_estimator="k1", loss_type="bnpo")
    loss, stats = grpo_loss(logp, mb, cfg, loss_scale(mb, 1, None, 1))
    assert loss.item() == pytest.approx(-1.0 * 3.0 + 0.1 * 0.5, abs=1e-6)
    assert stats["kl"] == pytest.approx(0.5)


def test_micro_batch_and_rank_scaling():
    """Each loss type divides by its count over the whole optimizer step (micro-batches of any size, all ranks)
    and undoes FSDP's average over ranks, except bnpo, a mean over each rank's own tokens."""
    logp = torch.tensor([[0.1, 0.1]])
    mb = _rollout(torch.tensor([1.0]), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long))
    cfg = LossConfig(importance_sampling_cap=0)
    spread = LossScale(tokens=8, rank_tokens=4, sequences=3, all_sequences=5, max_tokens=6, world=4)
    total = -2 * math.exp(0.1)                   # two tokens, ratio e^0.1 (not clipped), advantage 1
    for loss_type, expected in {"dapo": total / 8 * 4, "bnpo": total / 4, "grpo": total / 2 / 3 * 4,
                                "dr_grpo": total / (5 * 6) * 4}.items():
        cfg.loss_type = loss_type
        assert grpo_loss(logp, mb, cfg, spread)[0].item() == pytest.approx(expected), loss_type


PROMPTS = [[5, 6, 7, 8], [9, 10]]
COMPLETIONS = [[11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21], [22, 23], [24]]
GROUP_OF = [0, 0, 0, 1, 1, 1]


def tiny_llama(hidden_size: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=hidden_size, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64))


# The GPU when there is one (FlexAttention's GPU kernel takes heads of 16 or more: hidden_size=64), for every
# FlexAttention test alike: one pytest process that ran it on the CPU and then on the GPU crashed (an H200)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ragged_rollout() -> Rollout:
    """Two groups of 3: left-padded prompts of 4 and 2 tokens, completions of 1-5 tokens."""
    P, C = 4, 5
    prompt_ids = torch.tensor([[0] * (P - len(PROMPTS[g])) + PROMPTS[g] for g in GROUP_OF])
    prompt_mask = torch.tensor([[0] * (P - len(PROMPTS[g])) + [1] * len(PROMPTS[g]) for g in GROUP_OF])
    completion_ids = torch.tensor([c + [0] * (C - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in COMPLETIONS])
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(6, C),
                   torch.zeros(6, dtype=torch.bool), list(GROUP_OF))


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_token_logprobs_with_shared_prompts_equal_one_sequence_at_a_time(attention):
    """The trainer computes each prompt once per group and packs the group's completions by their lengths; the
    logprobs and entropies must be those of each sequence run alone (left-padded prompts, ragged completions),
    with SDPA's dense mask (CPU) and FlexAttention's block mask (GPU; its forward runs on CPU too)."""
    model, part = tiny_llama(hidden_size=64).to(DEVICE), ragged_rollout()
    model.set_attn_implementation(attention)
    with torch.no_grad():
        logp, entropy = token_logprobs(model, part, temperature=0.7, with_entropy=True)
        for s, (g, c) in enumerate(zip(GROUP_OF, COMPLETIONS)):
            alone = model(torch.tensor([PROMPTS[g] + c], device=DEVICE)).logits[0].float()
            alone = torch.log_softmax(alone / 0.7, -1)[len(PROMPTS[g]) - 1:-1]     # [len(c), V]
            want = alone.gather(-1, torch.tensor(c, device=DEVICE).unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(logp[s, :len(c)], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[s, :len(c)], -(alone.exp() * alone).sum(-1), atol=1e-5, rtol=0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert shared_prompt_rows(part).input_ids.shape[0] == 2                # one row per group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chosen_logprobs_equal_log_softmax_in_value_entropy_and_gradient(dtype, monkeypatch):
    """The chunked softmax (`forge_core.logprobs`) against the plain one: rows read several times (a group's
    first tokens all follow its prompt's last position), a temperature, chunks that split the rows unevenly."""
    monkeypatch.setitem(forge_core.logprobs._CHUNK_BYTES, DEVICE.type, 7 * 4 * 300)    # 7 rows of 300 per chunk
    torch.manual_seed(0)
    logits = (torch.randn(40, 300) * 4).to(DEVICE, dtype).requires_grad_()
    rows, ids = torch.randint(0, 40, (6, 9), device=DEVICE), torch.randint(0, 300, (6, 9), device=DEVICE)
    rows[:, 0] = 3
    weights = torch.randn(6, 9, device=DEVICE)
    plain = torch.log_softmax(logits.float() / 0.7, -1)
    picked, entropy = forge_core.logprobs.chosen_logprobs(logits, rows, ids, 0.7, with_entropy=True)
    torch.testing.assert_close(picked, plain[rows, ids], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(plain.exp() * plain).sum(-1).detach(), atol=1e-4, rtol=0)
    want, = torch.autograd.grad((plain[rows, ids] * weights).sum(), logits)
    got, = torch.autograd.grad((picked * weights).sum(), logits)
    torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no CPU backward: GPU only")
def test_block_mask_gradients_equal_the_dense_masks_on_gpu():
    """What a GPU trainer's backward gets from the block mask: the dense mask's gradients."""
    grads = {}
    for attention in ("sdpa", "flex_attention"):
        model = tiny_llama(hidden_size=64).cuda()
        model.set_attn_implementation(attention)
        token_logprobs(model, ragged_rollout(), temperature=1.0)[0].sum().backward()
        grads[attention] = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads["flex_attention"], grads["sdpa"], atol=1e-5, rtol=1e-4)


def test_rows_with_the_same_prompt_are_not_packed_together():
    """A game's episodes all start from one message: each data row's group gets its own packed row, else one row
    would hold the whole batch (its attention mask grows with the square of that)."""
    part = ragged_rollout()
    part.prompt_ids[:], part.prompt_mask[:] = part.prompt_ids[0], part.prompt_mask[0]
    assert shared_prompt_rows(part).input_ids.shape[0] == 2


def test_a_dropped_group_leaves_the_loss_not_the_layout():
    """Dynamic sampling drops zero-variance groups from the loss only: every sequence keeps its logprobs (the
    trainer lays completions out as generated, not as the loss counts them: laid out as empty, a dropped
    sequence would read logits of the wrong positions), and the loss is the kept group's alone."""
    model, part = tiny_llama(), ragged_rollout()
    with torch.no_grad():
        before = token_logprobs(model, part, temperature=1.0)[0]
    part.kept = torch.tensor([True] * 3 + [False] * 3)
    logp = token_logprobs(model, part, temperature=1.0)[0]
    assert torch.equal(logp.detach(), before)
    part.advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0, 0.0])
    part.old_logprobs = logp.detach() + torch.tensor([0.1] * 3 + [2.0] * 3).unsqueeze(1)
    part.ref_logprobs = logp.detach() + torch.tensor([0.2] * 3 + [-3.0] * 3).unsqueeze(1)
    cfg = LossConfig(beta=0.04)
    loss, _ = grpo_loss(logp, part, cfg, loss_scale(part, 5, None, 1))
    kept_only, _ = grpo_loss(logp[:3], part.select(slice(0, 3)), cfg, loss_scale(part, 5, None, 1))
    torch.testing.assert_close(loss, kept_only)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def random_share(rank: int, groups: int, G: int, seed: int) -> Rollout:
    """One rank's rollout: `groups` prompts of 3-12 tokens, G completions of 1-10 tokens each (ids < 50)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 50, (int(torch.randint(3, 13, (), generator=gen)),), generator=gen).tolist()
               for _ in range(groups)]
    completions = [torch.randint(1, 50, (int(torch.randint(1, 11, (), generator=gen)),), generator=gen).tolist()
                   for _ in range(groups * G)]
    prompt_ids, prompt_mask = (t.repeat_interleave(G, 0) for t in pad_left(prompts, 0))
    completion_ids, completion_mask = pad_right(completions, 0)
    logprobs, _ = pad_right([[-0.1 * len(c)] * len(c) for c in completions], 0.0, dtype=torch.float32)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs,
                   torch.zeros(groups * G, dtype=torch.bool), [100 * rank + g for g in range(groups) for _ in range(G)])


def test_balanced_share_deals_whole_groups_of_like_width_and_keeps_every_logprob():
    """Two ranks, two mini-batches of four groups each, micro-batches of two groups: every sequence ends up on
    exactly one rank, whole groups in their own mini-batch; the micro-batches side by side are as wide as sorting
    allows (never wider than as sampled); each moved sequence has the logprobs it had on its own rank."""
    G, micro, mini = 3, 6, 12
    model = tiny_llama()

    def sequences(p: Rollout) -> dict[tuple, tuple[Tensor, Tensor]]:
        """(row, completion) -> (trainer's logprobs, sampler's), each cut to the completion's length."""
        with torch.no_grad():
            logp = token_logprobs(model, p, temperature=1.0)[0]
        lengths = p.completion_mask.sum(1).tolist()
        return {(r, tuple(c[:n].tolist())): (lp[:n], s[:n]) for r, c, n, lp, s in
                zip(p.row_ids, p.completion_ids, lengths, logp, p.sampler_logprobs)}

    def widths(parts: list[Rollout]) -> list[int]:      # each micro-batch's packed width, the largest over ranks
        return [max(shared_prompt_rows(p.select(slice(k, k + micro))).input_ids.shape[1] for p in parts)
                for k in range(0, 2 * mini, micro)]

    for seed in range(3):
        shares = [random_share(rank, 8, G, seed * 2 + rank) for rank in range(2)]
        dealt = [balanced_share(shares, me, G, micro, mini) for me in range(2)]
        assert sum(widths(dealt)) <= sum(widths(shares))
        for m in range(2):
            assert sorted(r for p in dealt for r in p.row_ids[m * mini:(m + 1) * mini]) == \
                sorted(r for p in shares for r in p.row_ids[m * mini:(m + 1) * mini])
        for p in dealt:
            assert p.row_ids[::G] == p.row_ids[G - 1::G]                     # groups whole and contiguous
            assert p.prompt_mask[:, 0].any()                                  # no prompt column of padding only
        before = sequences(shares[0]) | sequences(shares[1])
        after = sequences(dealt[0]) | sequences(dealt[1])
        assert after.keys() == before.keys()
        for key, (logp, sampled) in after.items():
            torch.testing.assert_close(logp, before[key][0], atol=1e-5, rtol=0)
            assert torch.equal(sampled, before[key][1])


def test_every_loss_type_and_reward_scaling_is_its_definition_in_a_two_rank_step():
    """train_on_rollout on 2 FSDP ranks, micro-batches of unequal size, a dropped group and NaN where no token is
    (tests/loss_check.py) makes the update of the loss as defined over the whole batch, computed in one process:
    grpo averaged dropped sequences in, micro-batches weighed alike whatever their size, `scale_rewards: batch`
    took each rank's std, and a NaN times a zero mask made the loss NaN."""
    from conftest import run_script
    proc = run_script("tests/loss_check.py", [], nproc=2)
    differences = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(differences) == 7 and all(d < 1e-5 for d in differences.values()), differences


def test_a_masked_non_finite_value_does_not_reach_the_loss_or_its_gradient():
    """Observation and pad positions hold whatever they hold (NaN, inf): the loss and its gradient are those of
    the same batch with zeros there."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    clean_logp = torch.tensor([[-0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]])
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = LossConfig(loss_type=loss_type, beta=0.1)
        results = []
        for fill in (0.0, float("nan"), float("inf")):
            hole = mask == 0
            logp = clean_logp.masked_fill(hole, fill).requires_grad_()
            mb = _rollout(torch.tensor([1.0, -0.5]), clean_logp.masked_fill(hole, fill),
                          torch.full((2, 3), -0.7).masked_fill(hole, fill), mask,
                          ref=torch.full((2, 3), -0.6).masked_fill(hole, -fill))
            loss, _ = grpo_loss(logp, mb, cfg, loss_scale(mb, 3, None, 1))
            loss.backward()
            results.append((loss.item(), logp.grad))
        assert all(math.isfinite(loss) and torch.isfinite(grad).all() for loss, grad in results), loss_type
        assert results[1][0] == results[0][0] == results[2][0]
        torch.testing.assert_close(results[1][1], results[0][1])
