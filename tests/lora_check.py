"""2 policy ranks (torchrun), a LoRA adapter on every linear layer, FSDP2-sharded: after each of several optimizer
steps and syncs the engine computes with the merged weights (W + scale * B @ A, of the gathered model) and gives
the logprobs of an HF model holding them (and, to rounding, the adapted model's, which adds B @ A x apart); the base weights never changed, the adapter did; the base model is the
file's (the reference policy).

    torchrun --nproc_per_node 2 tests/lora_check.py MODEL_DIR OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge_core.data import chat_prompt_ids
from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine, generate
from forge_core.lora import LoRAConfig, base_model, hf_name
from forge_core.model import FSDPConfig, ModelConfig, load_tokenizer
from forge_core.optim import OptimConfig, build_optimizer, optimizer_step
from forge_core.sync import WeightSync, engine_state_dict
from forge_core.weights import build_model, hf_tensors
from sync_check import fuse_like_vllm
from train_grpo import token_logprobs

STEPS = 3


def main(model_dir: str, out_dir: str) -> None:
    roles = init_roles(Layout(policy=int(os.environ["WORLD_SIZE"]), reference=0, reward=0))
    cfg = ModelConfig(path=model_dir, lora=LoRAConfig(rank=4, alpha=8.0))
    tokenizer = load_tokenizer(cfg)
    policy = build_model(cfg, roles.policy_mesh, FSDPConfig(), seed=0)
    optim, sched = build_optimizer(policy, OptimConfig(lr=1e-2), total_steps=STEPS)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    engine = build_engine(model_dir, EngineConfig(block_size=32), seed=0)
    weight_sync = WeightSync(policy, engine)
    prompts = [chat_prompt_ids(tokenizer, p) for p in ["12+34=", "500+499=", "7+8="]]
    sampling = SamplingConfig(num_generations=4, max_tokens=8)
    file = load_file(next(Path(model_dir).glob("*.safetensors")))
    weight_gaps, logprob_gaps, adapted_gaps = [], [], []
    merged_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for step in range(STEPS):
        torch.manual_seed(100 * step + roles.rank)
        ids = torch.randint(0, 300, (4, 12))
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer_step(policy, optim, sched, max_grad_norm=0)
        weight_sync()
        full = dict(hf_tensors(policy))
        merged = fuse_like_vllm(full)
        engine_weights = engine_state_dict(engine)
        weight_gaps.append(max((engine_weights[n] - merged[n]).abs().max().item() for n in engine_weights))
        sampled = generate(engine, prompts, [0, 1, 2], sampling, tokenizer.pad_token_id, seed=step)
        mask = sampled.completion_mask.bool()
        merged_model.load_state_dict(full)
        with torch.no_grad():
            trainer, _ = token_logprobs(policy, sampled, temperature=1.0)
            of_merged, _ = token_logprobs(merged_model, sampled, temperature=1.0)
        logprob_gaps.append((of_merged - sampled.sampler_logprobs)[mask].abs().max().item())
        adapted_gaps.append((trainer - sampled.sampler_logprobs)[mask].abs().max().item())
    with torch.no_grad(), base_model(policy):
        reference, _ = token_logprobs(policy, sampled, temperature=1.0)
        untrained, _ = token_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), sampled,
                                      temperature=1.0)
    merged = dict(hf_tensors(policy, with_tied_head=False))
    base = {hf_name(n): getattr(t, "full_tensor", lambda: t)() for n, t in policy.state_dict().items()
            if ".lora_" not in n}
    result = {"trained": len(trained), "trained_not_adapter": [n for n in trained if ".lora_" not in n],
              "weight_gaps": weight_gaps, "logprob_gaps": logprob_gaps, "adapted_gaps": adapted_gaps,
              "reference_gap": (reference - untrained)[mask].abs().max().item(),
              "adapted_gap": (reference - trainer)[mask].abs().max().item(),
              "base_unchanged": all(torch.equal(base[n], file[n]) for n in file),
              "merged_changed": len([n for n in file if not torch.equal(merged[n], file[n])])}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{roles.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1], sys.argv[2]))
