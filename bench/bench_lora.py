"""A LoRA-adapted policy's engine, two ways: merged weights (what `forge_core.sync.WeightSync` pushes, W + (alpha / r)
B A) against vLLM's own LoRA on the base weights. Generation tokens/s of each on the same prompts and sampling, what
bringing a changed adapter into the engine costs (seconds, bytes), and whether both give the same greedy completions.

    python bench/bench_lora.py                       # runs/sft-tiny/hf (make run's SFT model); ~80 s
    python bench/bench_lora.py --prompts 8 --updates 2

Each way runs in a 1-rank torchrun job of its own (OMP_NUM_THREADS=1), one after the other, on the same policy: the
model of --model with a peft adapter (rank --rank, alpha 2 x rank) on every linear layer whose B is drawn anew
(normal, std 0.05, seeded) at the start and at each update, so that both ways see the same adapters and the merged
weights are not the base's.
- merged: `build_engine` (default EngineConfig: the model's dtype on CPU, eager, prefix caching), brought to each
  adapter by a `WeightSync` call.
- vLLM LoRA: the same engine with enable_lora, max_loras=1 and max_lora_rank the smallest vLLM takes >= --rank, every
  request carrying the adapter's LoRARequest. An update writes peft's adapter directory into /dev/shm, reloads it
  under the same id (`llm_engine.add_lora` with load_inplace=True: without it vLLM keeps the adapter it holds) and
  resets the prefix cache (vLLM keys cached blocks by the adapter's name and path, not its weights). The requests
  carry load_inplace=False: with True the engine loads the adapter from disk again at every engine step.
- tokens/s: the completion tokens of --repeats generates after each update over their seconds (the first prompts of
  artifacts/tiny/data/eval.jsonl in the chat template, --num_generations samples each at T=1, at most --max_tokens),
  after one generate not timed.
- update: the median seconds of the --updates updates and the bytes each moves into the engine (merged: the full
  weights; vLLM LoRA: the adapter's files).
- correctness: after the last update, one greedy completion of every prompt; the share alike token for token, and
  how many of them the adapter changed (the LoRA engine's own greedy completions without it).
"""

import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

import tyro

from bench_grpo import REPO, last_json, run_checked, torchrun

sys.path.insert(0, str(REPO))
PROMPTS = REPO / "artifacts" / "tiny" / "data" / "eval.jsonl"
B_STD = 0.05               # lora_B's draws: enough to change a third of the tiny model's greedy completions
ADAPTER = "policy"          # the LoRARequest's name; its id is 1


@dataclass
class LoRABench:
    model: str = "runs/sft-tiny/hf"
    prompts: int = 64
    num_generations: int = 8
    max_tokens: int = 8
    rank: int = 16
    updates: int = 3
    repeats: int = 3                    # timed generates after each update
    way: Literal["", "merged", "lora"] = ""     # internal: run one way in this torchrun job, print its JSON


def draw_adapter(model, seed: int) -> None:
    """Every lora_B of the (1-rank) policy drawn anew from `seed`: a changed adapter, as after a training step."""
    import torch

    from forge_core.lora import local_shard
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                local_shard(param).normal_(0, B_STD, generator=generator)


class Merged:
    def __init__(self, policy, cfg: LoRABench):
        from forge_core.engine import EngineConfig, build_engine
        from forge_core.sync import WeightSync
        self.llm, self.request = build_engine(cfg.model, EngineConfig(), seed=0), None
        self.sync = WeightSync(policy, self.llm)

    def update(self) -> tuple[float, int]:
        stats = self.sync()
        return stats.seconds, stats.bytes


class VLLMLoRA:
    def __init__(self, policy, cfg: LoRABench, adapter_dir: str):
        from vllm.lora.request import LoRARequest
        self.policy, self.dir, self.llm = policy, adapter_dir, lora_engine(cfg.model, cfg.rank)
        self.request = LoRARequest(ADAPTER, 1, adapter_dir)
        self.update()

    def update(self) -> tuple[float, int]:
        from vllm.lora.request import LoRARequest

        from forge_core.lora import save_adapter
        from forge_core.weights import full_tensor
        t0 = time.perf_counter()
        adapter = {n: full_tensor(t) for n, t in self.policy.state_dict().items() if ".lora_" in n}
        save_adapter(self.policy, adapter, self.dir)
        self.llm.llm_engine.add_lora(LoRARequest(ADAPTER, 1, self.dir, load_inplace=True))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0, sum(f.stat().st_size for f in Path(self.dir).iterdir())


def lora_engine(model: str, rank: int):
    """`build_engine`'s engine with vLLM's LoRA switched on (max_lora_rank: the smallest vLLM takes >= rank)."""
    from vllm.config.lora import MaxLoRARanks

    from forge_core.engine import EngineConfig, build_engine
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in get_args(MaxLoRARanks) if r >= rank))
    return build_engine(model, EngineConfig(), seed=0, vllm_args=lora)


def timed_generate(llm, request, prompts: list[list[int]], params, seed: int) -> tuple[list[list[int]], float]:
    from forge_core.engine import seeded_draws
    with seeded_draws(seed):
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False,
                               lora_request=request)
        seconds = time.perf_counter() - t0
    return [list(sample.token_ids) for out in outputs for sample in out.outputs], seconds


def run_way(cfg: LoRABench) -> None:
    from forge_core.data import chat_prompt_ids
    from forge_core.dist import Layout, init_roles
    from forge_core.engine import SamplingConfig, sampling_params
    from forge_core.lora import LoRAConfig
    from forge_core.model import FSDPConfig, ModelConfig, load_tokenizer
    from forge_core.weights import build_model
    roles = init_roles(Layout(policy=1, reference=0, reward=0))
    model_cfg = ModelConfig(path=cfg.model, lora=LoRAConfig(rank=cfg.rank, alpha=2.0 * cfg.rank))
    tokenizer = load_tokenizer(model_cfg)
    policy = build_model(model_cfg, roles.policy_mesh, FSDPConfig(), seed=0)
    draw_adapter(policy, seed=0)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:cfg.prompts]]
    prompts = [chat_prompt_ids(tokenizer, row["prompt"]) for row in rows]
    sampling = SamplingConfig(num_generations=cfg.num_generations, max_tokens=cfg.max_tokens)
    params = sampling_params(sampling, False, n=cfg.num_generations, max_tokens=cfg.max_tokens, detokenize=False)
    greedy = sampling_params(sampling, True, n=1, max_tokens=cfg.max_tokens, detokenize=False)
    adapter_dir = tempfile.mkdtemp(prefix="bench_lora-", dir="/dev/shm")
    try:
        way = Merged(policy, cfg) if cfg.way == "merged" else VLLMLoRA(policy, cfg, adapter_dir)
        timed_generate(way.llm, way.request, prompts, params, seed=0)
        tokens, seconds, updates = 0, 0.0, []
        for u in range(cfg.updates):
            draw_adapter(policy, seed=u + 1)
            updates.append(way.update())
            for i in range(cfg.repeats):
                completions, s = timed_generate(way.llm, way.request, prompts, params,
                                                seed=1 + u * cfg.repeats + i)
                tokens, seconds = tokens + sum(map(len, completions)), seconds + s
        result = {"greedy": timed_generate(way.llm, way.request, prompts, greedy, seed=0)[0]}
        if cfg.way == "lora":        # the same engine without the adapter
            result["base_greedy"] = timed_generate(way.llm, None, prompts, greedy, seed=0)[0]
    finally:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    print(json.dumps(result | {"tokens_per_s": tokens / seconds, "update_s": statistics.median(s for s, _ in updates),
                               "update_bytes": updates[-1][1]}), flush=True)


def main(cfg: LoRABench) -> None:
    flags = [arg for name, value in asdict(cfg).items() if name != "way" for arg in (f"--{name}", str(value))]
    results = {way: last_json(run_checked(torchrun(1, __file__, "--way", way, *flags))[0])
               for way in ("merged", "lora")}
    merged, lora = results["merged"], results["lora"]
    for label, r in (("merged", merged), ("vLLM LoRA", lora)):
        print(f"{label}: {r['tokens_per_s']:,.0f} generation tok/s; update {r['update_s']:.4f} s, "
              f"{r['update_bytes'] / 1e6:.3f} MB into the engine")
    n = len(merged["greedy"])
    alike = sum(a == b for a, b in zip(merged["greedy"], lora["greedy"]))
    changed = sum(a != b for a, b in zip(lora["greedy"], lora["base_greedy"]))
    print(f"greedy completions alike after the same adapter: {alike}/{n} ({alike / n:.0%}); the adapter changed "
          f"{changed}/{n} of the base model's")
    x, y = merged["tokens_per_s"], lora["tokens_per_s"]
    print(f"lora engine: merged {x:,.0f} tok/s, vLLM LoRA {y:,.0f} tok/s (Y/X = {y / x:.2f}); update: merged "
          f"{merged['update_s']:.4f} s ({merged['update_bytes'] / 1e6:.3f} MB), adapter {lora['update_s']:.4f} s "
          f"({lora['update_bytes'] / 1e6:.3f} MB)")


if __name__ == "__main__":
    args = tyro.cli(LoRABench, use_underscores=True)
    if args.way:
        from forge_core.dist import run_main
        run_main(lambda: run_way(args))
    else:
        main(args)
