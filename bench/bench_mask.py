"""What the trainer's attention mask costs. GRPO's trainer packs each prompt once with its G completions
(`forge_core.rollout.shared_prompt_rows`) and lets each completion see only its prompt and itself: SDPA takes
that as a dense boolean mask [u, 1, L, L] (no fused causal path, L^2 booleans); FlexAttention (GPU) as a
block mask whose kernel skips the blocks no query sees.

The layouts of one micro-batch, forward + backward of `token_logprobs` (what a GRPO micro-batch runs):
  packed, dense mask   train_grpo.py with `model.attention: sdpa` (the CPU default)
  packed, block mask   train_grpo.py with `model.attention: flex_attention` (the GPU default; GPU only: FlexAttention
                       has no CPU backward)
  packed, causal only  the same tokens with the plain causal mask: what a block-aware kernel could reach at best;
                       numerically wrong (completions see each other)
  unpacked             each sequence alone, prompt repeated G times, left/right padding masked
and the attention kernels alone at the Qwen3-1.7B config's shape (one row: prompt + 8 x 512 completion tokens,
16 heads of 128).

    python bench/bench_mask.py --model artifacts/smollm2-135m          # the SmolLM2 GRPO workload's shape (CPU)
    python bench/bench_mask.py --model qwen3-1.7b-random --prompts 1 --prompt-tokens 150 --completion-tokens 512
                                                                       # the Qwen3-1.7B config's micro-batch (GPU)
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

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Qwen/Qwen3-1.7B's config.json (no hub here: random weights of the same shape time the same)
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


def fake_rollout(vocab: int, prompts: int, G: int, P: int, C: int, seed: int = 0) -> Rollout:
    """`prompts` groups of G completions whose lengths spread over C/2..C, as sampled ones do."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (prompts, P), generator=g).repeat_interleave(G, 0)
    lengths = torch.randint(C // 2, C + 1, (prompts * G,), generator=g)
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (prompts * G, C), generator=g) * completion_mask
    n = prompts * G
    part = Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, torch.zeros(n, C),
                   torch.zeros(n, dtype=torch.bool), [i // G for i in range(n)])
    return part.to(DEVICE)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def seconds(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def unpacked_logprobs(model, part: Rollout) -> torch.Tensor:
    ids = torch.cat([part.prompt_ids, part.completion_ids], 1)
    mask = torch.cat([part.prompt_mask, part.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=part.completion_ids.shape[1] + 1,
                   use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, part.completion_ids[..., None])[..., 0]


def load(model_dir: str):
    """The model in what the trainer computes in: bf16 on GPU (FSDP's mixed precision), fp32 on CPU."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    if model_dir == "qwen3-1.7b-random":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_1_7B), dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(DEVICE)


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else float("nan")


def model_layouts(model_dir: str, prompts: int, G: int, P: int, C: int, repeats: int) -> None:
    model = load(model_dir)
    part = fake_rollout(model.config.vocab_size, prompts, G, P, C)
    rows = shared_prompt_rows(part)

    def packed():
        token_logprobs(model, part, 1.0)[0].sum().backward()

    def causal_only():              # same ids and positions, no mask: HF's SDPA runs is_causal
        logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=None,
                       logits_to_keep=rows.logits_to_keep, use_cache=False).logits
        torch.log_softmax(logits.float(), -1).flatten(0, 1)[rows.logits_index, part.completion_ids].sum().backward()

    def unpacked():
        unpacked_logprobs(model, part).sum().backward()

    u, L = rows.input_ids.shape
    layouts = [("packed, dense mask", "sdpa", packed, u * L)]
    if DEVICE.type == "cuda":
        layouts.append(("packed, block mask", "flex_attention", packed, u * L))
    layouts += [("packed, causal only", "sdpa", causal_only, u * L),
                ("unpacked", "sdpa", unpacked, len(part) * (P + C))]
    print(f"{model_dir} on {DEVICE.type}: {prompts} prompts x G={G}, prompt {P}, completions {C // 2}-{C} tokens; "
          f"packed rows {u} x {L}")
    print("| layout | tokens | fwd+bwd s | vs packed, dense mask | peak GiB |\n|---|---:|---:|---:|---:|")
    base = None
    for name, attention, fn, tokens in layouts:
        model.set_attn_implementation(attention)
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        s = seconds(fn, repeats)
        model.zero_grad(set_to_none=True)
        base = base or s
        print(f"| {name} | {tokens} | {s:.3f} | {s / base:.2f} | {peak_gib():.1f} |")
    if DEVICE.type == "cuda":
        block_mask_checks(model, prompts, G, P, C)


def block_mask_checks(model, prompts: int, G: int, P: int, C: int) -> None:
    """The block mask's logprobs against the dense mask's, in the trainer's bf16 and in fp32 (beside the dense
    mask's own bf16-vs-fp32 gap, the scale of bf16's rounding), and its time on batches of new lengths
    (FlexAttention is compiled: a recompilation per batch width would show here)."""
    times = []
    for seed in (2, 3, 4):
        part = fake_rollout(model.config.vocab_size, prompts, G, P, C, seed=seed)
        times.append(seconds(lambda: token_logprobs(model, part, 1.0)[0].sum().backward(), 1, warmup=False))
    model.zero_grad(set_to_none=True)
    part = fake_rollout(model.config.vocab_size, prompts, G, P, C, seed=1)
    logprobs = {}
    for dtype in (torch.bfloat16, torch.float32):
        model.to(dtype)
        for attention in ("sdpa", "flex_attention"):
            model.set_attn_implementation(attention)
            with torch.no_grad():
                logprobs[dtype, attention] = token_logprobs(model, part, 1.0)[0]

    def gap(a, b) -> str:
        return f"{((logprobs[a] - logprobs[b]).abs() * part.completion_mask).max().item():.1e}"
    bf16, fp32 = torch.bfloat16, torch.float32
    print(f"logprobs, largest gap: block vs dense mask {gap((bf16, 'sdpa'), (bf16, 'flex_attention'))} in bf16, "
          f"{gap((fp32, 'sdpa'), (fp32, 'flex_attention'))} in fp32; dense mask bf16 vs fp32 "
          f"{gap((bf16, 'sdpa'), (fp32, 'sdpa'))}")
    print(f"block mask fwd+bwd on 3 batches of new widths: {', '.join(f'{t:.3f}' for t in times)} s")


def attention_alone(G: int, P: int, C: int, heads: int, head_dim: int) -> None:
    """The attention kernels alone, forward + backward, on one shared-prompt row: SDPA with its dense mask,
    SDPA's fused causal path (all pairs before each token: a lower bound on the work), and on GPU FlexAttention
    with the block mask."""
    from torch.nn.attention.flex_attention import flex_attention
    rows = shared_prompt_rows(fake_rollout(1000, 1, G, P, C))
    L = rows.input_ids.shape[1]
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, heads, L, head_dim, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(3))
    kernels = {"dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=rows.attention_mask()),
               "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    if DEVICE.type == "cuda":
        block_mask = rows.attention_mask(block_sparse=True)
        flex = torch.compile(flex_attention)
        kernels["block mask"] = lambda: flex(q, k, v, block_mask=block_mask)
        kernels["block mask, built each call"] = lambda: flex(q, k, v, block_mask=rows.attention_mask(True))
    times = {name: seconds(lambda: fn().sum().backward(), 1 if DEVICE.type == "cpu" else 10)
             for name, fn in kernels.items()}
    print(f"\nattention fwd+bwd, one row of {L} tokens (prompt {P} + {G} x {C // 2}-{C}), {heads} heads x "
          f"{head_dim}, {dtype}: " + ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in times.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/smollm2-135m", help="an HF directory, or qwen3-1.7b-random")
    p.add_argument("--prompts", type=int, default=2, help="groups per micro-batch (2 x 8 = the SmolLM2 config's 16)")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=57)
    p.add_argument("--completion-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention-completion-tokens", type=int, default=512,
                   help="the attention-alone row: 150 prompt tokens + G completions of up to this many (Qwen3-1.7B)")
    args = p.parse_args()
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    model_layouts(args.model, args.prompts, args.G, args.prompt_tokens, args.completion_tokens, args.repeats)
    attention_alone(args.G, 150, args.attention_completion_tokens, heads=16, head_dim=128)


if __name__ == "__main__":
    main()
