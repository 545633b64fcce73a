"""What the trainer's dense attention mask costs. GRPO's trainer packs each prompt once with its G completions
(`forge_core.rollout.shared_prompt_rows`) and lets each completion see only its prompt and itself through a 4-D
boolean mask [u, 1, L, L]: SDPA then cannot take its fused causal path, and the mask grows with L^2.

Three layouts of the same batch, forward + backward of `token_logprobs` (what a GRPO micro-batch runs):
  packed, dense mask   what train_grpo.py does
  packed, causal only  the same tokens with the plain causal mask: what a block-aware kernel (varlen /
                       FlexAttention) could reach at best; numerically wrong (completions see each other)
  unpacked             each sequence alone, prompt repeated G times, left/right padding masked
and SDPA alone at the Qwen3-1.7B config's shape (one row: prompt + 8 x 512 completion tokens, 16 heads of 128).

    python bench/bench_mask.py --model artifacts/smollm2-135m          # the SmolLM2 GRPO workload's shape
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from forge_core.rollout import Rollout, shared_prompt_rows  # noqa: E402
from train_grpo import token_logprobs  # noqa: E402


def fake_rollout(vocab: int, prompts: int, G: int, P: int, C: int) -> Rollout:
    """`prompts` groups of G completions whose lengths spread over C/2..C, as sampled ones do."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (prompts, P), generator=g).repeat_interleave(G, 0)
    lengths = torch.randint(C // 2, C + 1, (prompts * G,), generator=g)
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (prompts * G, C), generator=g) * completion_mask
    n = prompts * G
    return Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, torch.zeros(n, C),
                   torch.zeros(n, dtype=torch.bool), [i // G for i in range(n)])


def seconds(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def unpacked_logprobs(model, part: Rollout) -> torch.Tensor:
    ids = torch.cat([part.prompt_ids, part.completion_ids], 1)
    mask = torch.cat([part.prompt_mask, part.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=part.completion_ids.shape[1] + 1,
                   use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, part.completion_ids[..., None])[..., 0]


def model_layouts(model_dir: str, prompts: int, G: int, P: int, C: int, repeats: int) -> None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    part = fake_rollout(model.config.vocab_size, prompts, G, P, C)
    rows = shared_prompt_rows(part)

    def packed(dense: bool):
        def run():
            if dense:
                logp, _ = token_logprobs(model, part, 1.0)
            else:                   # same ids and positions, no mask: HF's SDPA runs is_causal
                logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None,
                               logits_to_keep=rows.logits_to_keep, use_cache=False).logits
                logp = torch.log_softmax(logits.float(), -1).flatten(0, 1)[rows.logits_index, part.completion_ids]
            logp.sum().backward()
        return run

    def unpacked():
        unpacked_logprobs(model, part).sum().backward()

    u, L = rows.input_ids.shape
    print(f"{model_dir}: {prompts} prompts x G={G}, prompt {P}, completions {C // 2}-{C} tokens; packed rows {u} x {L}")
    print("| layout | tokens | fwd+bwd s | vs packed, dense mask |\n|---|---:|---:|---:|")
    base = None
    for name, fn, tokens in (("packed, dense mask", packed(True), u * L), ("packed, causal only", packed(False), u * L),
                             ("unpacked", unpacked, len(part) * (P + C))):
        s = seconds(fn, repeats)
        base = base or s
        print(f"| {name} | {tokens} | {s:.3f} | {s / base:.2f} |")


def attention_alone(L: int, heads: int, head_dim: int, repeats: int) -> None:
    """SDPA forward + backward on one row of L tokens: a dense boolean mask vs the fused causal path."""
    q, k, v = (torch.randn(1, heads, L, head_dim, requires_grad=True) for _ in range(3))
    dense = torch.ones(L, L, dtype=torch.bool).tril()[None, None]

    def run(**kwargs):
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs).sum().backward()
    masked, causal = seconds(run(attn_mask=dense), repeats), seconds(run(is_causal=True), repeats)
    print(f"\nSDPA fwd+bwd, one row of {L} tokens, {heads} heads x {head_dim}: dense mask {masked:.2f} s, causal "
          f"{causal:.2f} s ({masked / causal:.2f}x); the mask alone is {L * L / 2**20:.0f} MiB per row "
          f"(x {heads} heads of fp32 scores in the unfused path: {4 * heads * L * L / 2**30:.1f} GiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/smollm2-135m")
    p.add_argument("--prompts", type=int, default=2, help="groups per micro-batch (2 x 8 = the SmolLM2 config's 16)")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=57)
    p.add_argument("--completion-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--qwen3-row", type=int, default=150 + 8 * 512, help="L at the Qwen3-1.7B config's shape")
    args = p.parse_args()
    torch.set_num_threads(1)
    model_layouts(args.model, args.prompts, args.G, args.prompt_tokens, args.completion_tokens, args.repeats)
    attention_alone(args.qwen3_row, heads=16, head_dim=128, repeats=1)


if __name__ == "__main__":
    main()
