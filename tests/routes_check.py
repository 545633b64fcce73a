"""One rank (torchrun) for tests/test_moe.py: routing replay (forge_core/routes.py) against a real engine. The tiny
Qwen3-MoE's engine (fp32, prefix cache on) samples a rollout and reads its sequences again for their routes; the
trainer (the same weights in HF) computes the rollout's logprobs the way GRPO does (`token_logprobs`: shared-prompt
rows) with its routers first as they are, then nudged (as other kernels or bf16 would: their top-k differs for some
tokens), without and with replay. Prints one JSON line: what the routers disagreed on, whether the experts got
exactly the engine's routes under replay, the router's gradient, and the logprob gaps to the engine's.

    torchrun --standalone --nproc_per_node 1 tests/routes_check.py MODEL_DIR DATA_JSONL
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from forge_core.data import chat_prompt_ids, read_rows
from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine, generate
from forge_core.model import ModelConfig, load_tokenizer
from forge_core.moe import moe_blocks
from forge_core.rollout import shared_prompt_rows
from forge_core.routes import RoutingReplay, read_routes
from train_grpo import token_logprobs


def main(model_dir: str, data: str) -> None:
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    engine = build_engine(model_dir, EngineConfig(block_size=32), seed=0)
    prompts = [chat_prompt_ids(tokenizer, row["prompt"]) for row in read_rows(data)[:6]]
    rollout = generate(engine, prompts, list(range(len(prompts))), SamplingConfig(num_generations=4, max_tokens=6),
                       tokenizer.pad_token_id, seed=0)
    read_routes(engine, rollout)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    measure, replay = RoutingReplay(trainer, replay=False), RoutingReplay(trainer, replay=True)
    replay.replay = False       # two hook sets on one model: each turned on below in turn
    given = shared_prompt_rows(rollout).routes
    real = given[..., 0, 0] >= 0                                                  # [u, L] tokens with routes
    seen = []                                                                     # each layer's experts' routes
    blocks = moe_blocks(trainer)
    for block in blocks:
        block.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().clone()))

    def gap(with_replay: bool) -> float:
        replay.replay = with_replay
        seen.clear()
        trainer.zero_grad()
        logp, _ = token_logprobs(trainer, rollout, 1.0)
        mask = rollout.completion_mask.bool()
        logp.masked_fill(~mask, 0.0).sum().backward()
        return (logp.detach() - rollout.sampler_logprobs)[mask].abs().mean().item()

    as_is = {"gap": gap(False), **measure.metrics()}
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in blocks:
            block.gate.weight.add_(0.001 * torch.randn(block.gate.weight.shape, generator=noise))
    nudged = {"gap": gap(False), **measure.metrics()}
    replayed = {"gap": gap(True), **measure.metrics()}
    layers = given.shape[2]
    routes_equal = len(seen) == layers and all(
        torch.equal(seen[layer].view(*real.shape, -1)[real].sort(-1).values,
                    given[:, :, layer][real].long().sort(-1).values) for layer in range(layers))
    router_grad = sum(block.gate.weight.grad.abs().sum().item() for block in blocks)
    print(json.dumps({"as_is": as_is, "nudged": nudged, "replayed": replayed, "routes_equal": routes_equal,
                      "router_grad": router_grad}))


if __name__ == "__main__":
    run_main(lambda: main(*sys.argv[1:3]))
