"""Agentic GRPO on the calculator job (configs/grpo/tiny_calculator.yaml, 3 ranks): the cost of turns. The turn
loop's generation tokens/s beside one single-turn generate of as many tokens per sample on the same engine
settings, the share of a step spent waiting on tools, and the step's phases.

    python bench/bench_agent.py                      # about 3 minutes on 2 CPU cores, after `make run-agent`
    python bench/bench_agent.py --model artifacts/tiny_calculator/init --steps 4 --warmup_steps 1

- ours: train_grpo.py with the Calculator environment; medians over the steps after --warmup_steps of
  OUT/metrics.jsonl (generation excludes the tools' seconds, which are a phase of their own).
- single-turn peer: a plain-process vLLM engine (fp32, eager, same KV block size and max_num_seqs) on the same
  prompts, one request of n=G samples each, every sample exactly as many tokens as the turn loop's median episode
  generated (min_tokens = max_tokens, EOS ignored), token ids only.
Target: the turn loop's generation tokens/s at least 0.8 of the single-turn generate's.
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_grpo import REPO, last_json, run_checked, torchrun

FIGURES = ("time/step", "time/generate", "time/tools", "time/score", "time/train", "time/sync",
           "perf/generate_tokens_per_s", "episode/turns", "episode/tool_calls", "episode/model_tokens",
           "episode/env_tokens", "reward/mean")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/sft-tiny-calculator/hf", help="start model (from `make run-agent`)")
    p.add_argument("--config", default="configs/grpo/tiny_calculator.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup_steps", type=int, default=3, help="first steps are not timed")
    p.add_argument("--worker", choices=["single_turn"], help="internal: run the peer, print JSON")
    p.add_argument("--spec", default=None, help="internal: the worker's JSON input file")
    return p.parse_args(argv)


def single_turn_worker(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    sys.path.insert(0, str(REPO))
    from forge_core.engine import cpu_engine_setup, norm_kernels
    cpu_engine_setup(enforce_eager=True)     # as our engines run
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28, seed=0,
              block_size=spec["block_size"], max_num_seqs=spec["max_num_seqs"], **norm_kernels())
    params = SamplingParams(n=spec["G"], max_tokens=spec["tokens"], min_tokens=spec["tokens"], ignore_eos=True,
                            temperature=1.0, logprobs=0, detokenize=False)
    rates = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
        rates.append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates[1:])}


def run_ours(args: argparse.Namespace, out_dir: str) -> dict[str, float]:
    run_checked(torchrun(3, "train_grpo.py", "--config", args.config, "--model.path", args.model, "--out_dir",
                         out_dir, "--ckpt.resume", "never", "--ckpt.save_every", "0", "--train.eval_every", "0",
                         "--data.eval_rows", "16", "--train.steps", str(args.steps)))
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > args.warmup_steps]
    return {k: statistics.median(r[k] for r in timed) for k in FIGURES}


def peer_spec(args: argparse.Namespace, tokens: int) -> dict:
    sys.path.insert(0, str(REPO))
    from forge_core.config import load_config
    from forge_core.data import chat_prompt_ids, read_rows
    from train_grpo import GRPOConfig
    from transformers import AutoTokenizer
    cfg = load_config(GRPOConfig, ["--config", args.config])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = read_rows(cfg.data.path)[:cfg.train.prompts_per_step]
    return {"model": args.model, "prompts": [chat_prompt_ids(tokenizer, r["prompt"]) for r in rows],
            "G": cfg.sampling.num_generations, "tokens": tokens, "repeats": 6, "block_size": cfg.engine.block_size,
            "max_num_seqs": cfg.engine.max_num_seqs}


def report(ours: dict[str, float], peer: dict, tokens: int) -> str:
    ratio = ours["perf/generate_tokens_per_s"] / peer["tokens_per_s"]
    lines = ["| figure | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in ours.items()]
    lines += ["", "| generation | tokens/s | ratio | target |", "|---|---:|---:|---|",
              f"| turn loop ({ours['episode/turns']:.2f} turns, {ours['episode/model_tokens']:.1f} model tokens "
              f"per episode) | {ours['perf/generate_tokens_per_s']:.0f} | {ratio:.2f} | >= 0.8: "
              f"**{'yes' if ratio >= 0.8 else 'no'}** |",
              f"| single-turn generate, {tokens} tokens per sample | {peer['tokens_per_s']:.0f} | 1.00 | |",
              "", f"waiting on tools: {ours['time/tools'] / ours['time/step']:.1%} of a step "
              f"({ours['time/tools'] * 1e3:.1f} ms of {ours['time/step']:.3f} s)"]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(single_turn_worker(json.loads(Path(args.spec).read_text()))))
        return
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"bench error: no model at {args.model}: run `make run-agent` first, or pass --model")
    with tempfile.TemporaryDirectory() as out_dir:
        ours = run_ours(args, out_dir)
    tokens = max(1, round(ours["episode/model_tokens"]))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump(peer_spec(args, tokens), spec)
        spec.flush()
        peer = last_json(run_checked([sys.executable, __file__, "--worker", "single_turn", "--spec", spec.name])[0])
    print(report(ours, peer, tokens))
    print("raw numbers: " + json.dumps({"ours": ours, "single_turn": peer}))


if __name__ == "__main__":
    main()
