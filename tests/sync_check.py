"""A torchrun program for tests/test_grpo_e2e.py: FSDP-shard the tiny model over all ranks, change its weights
by an optimizer step, sync them into each rank's colocated vLLM engine, then check on every rank that
  - the engine's parameters equal the trainer's, bit for bit (vLLM fuses q/k/v and gate/up; we fuse too),
    both right after the engine starts and after the step,
  - greedy generation from vLLM equals greedy generation from the trainer's weights in HF,
  - vLLM's logprobs of sampled tokens equal the trainer's recomputed logprobs,
  - on CPU nothing was compiled on the way (`forge_core.engine.eager_everywhere`) and the engine draws by
    inverse CDF (`forge_core.engine.inverse_cdf_sampling`),
also for a prompt of several KV blocks that the engine cached before the step (a sync must drop that cache);
and that a snapshot of the first sync, written again after the step, gives the engine the start weights exactly.
Writes <out>/rank<r>.json.

    torchrun --standalone --nproc_per_node 2 tests/sync_check.py MODEL_DIR OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from forge_core.data import chat_prompt_ids
from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine, generate
from forge_core.model import FSDPConfig, ModelConfig, load_tokenizer
from forge_core.optim import OptimConfig, build_optimizer, optimizer_step
from forge_core.sync import WeightSync, engine_state_dict
from forge_core.weights import build_model
from train_grpo import token_logprobs


def fuse_like_vllm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fused = {}
    for name, t in state.items():
        if ".q_proj." in name:
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, state[name.replace("q_proj", "k_proj")], state[name.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in name:
            fused[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, state[name.replace("gate_proj", "up_proj")]])
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):     # MoE: vLLM's names
            fused[name.replace("gate_up_proj", "routed_experts.w13_weight")
                      .replace("down_proj", "routed_experts.w2_weight")] = t
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            fused[name] = t
    return fused


def full_state(policy) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in policy.state_dict().items()}


def mismatches(engine, policy) -> list[str]:
    """Names of the engine tensors that differ from the trainer's in any bit (all engine tensors compared)."""
    trainer = fuse_like_vllm(full_state(policy))
    mine = engine_state_dict(engine)
    assert len(mine) >= 27, f"only {len(mine)} engine tensors compared"
    return [n for n, p in mine.items() if not torch.equal(p, trainer[n])]


def sampler_name(worker) -> str:
    return worker.model_runner.sampler.topk_topp_sampler.forward.__qualname__


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def main(model_dir: str, out_dir: str) -> None:
    roles = init_roles(Layout(policy=int(os.environ["WORLD_SIZE"]), reference=0, reward=0))
    cfg = ModelConfig(path=model_dir)
    tokenizer = load_tokenizer(cfg)
    policy = build_model(cfg, roles.policy_mesh, FSDPConfig())
    optim, sched = build_optimizer(policy, OptimConfig(lr=1e-3), total_steps=1)
    engine = build_engine(model_dir, EngineConfig(block_size=32), seed=0)
    weight_sync = WeightSync(policy, engine)       # building it syncs: the engine computes with the trainer's weights
    fresh_mismatched = mismatches(engine, policy)
    start_snapshot, start_weights = weight_sync.snapshot(), engine_state_dict(engine)
    long_sum = "+".join(str(n) for n in range(10, 40)) + "="
    prompts = [chat_prompt_ids(tokenizer, p) for p in ["12+34=", "500+499=", "7+8=", long_sum]]
    assert len(prompts[-1]) > 3 * 32, len(prompts[-1])
    generate(engine, prompts, [0, 1, 2, 3], SamplingConfig(), tokenizer.pad_token_id, seed=0, greedy=True)  # caches

    torch.manual_seed(roles.rank)   # different data on every rank: the averaged update is what FSDP makes
    loss = policy(input_ids=torch.randint(0, 300, (4, 12)), labels=torch.randint(0, 300, (4, 12))).loss
    loss.backward()
    optimizer_step(policy, optim, sched, max_grad_norm=0)
    stats = weight_sync()

    full = full_state(policy)
    mismatched = mismatches(engine, policy)
    changed = not torch.equal(engine_state_dict(engine)["model.norm.weight"],
                              hf_model(model_dir).state_dict()["model.norm.weight"])

    sampling = SamplingConfig(num_generations=4, max_tokens=8)
    greedy = generate(engine, prompts, [0, 1, 2, 3], sampling, tokenizer.pad_token_id, seed=0, greedy=True)
    hf = hf_model(model_dir)
    hf.load_state_dict(full)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(p).flip(0) for p in prompts], batch_first=True,
                                          padding_value=tokenizer.pad_token_id).flip(1)
    mask = (torch.arange(ids.shape[1]).flip(0) < torch.tensor([len(p) for p in prompts]).unsqueeze(1)).long()
    hf_out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)[:, ids.shape[1]:]
    vllm_greedy = [c[m.bool()].tolist() for c, m in zip(greedy.completion_ids, greedy.completion_mask)]
    hf_greedy = [[t for t in row.tolist() if t != tokenizer.pad_token_id] for row in hf_out]
    hf_greedy = [row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row for row in hf_greedy]

    sampled = generate(engine, prompts, [0, 1, 2, 3], sampling, tokenizer.pad_token_id, seed=1)
    with torch.no_grad():
        trainer_logprobs, _ = token_logprobs(policy, sampled, temperature=1.0)
    mask = sampled.completion_mask.bool()
    gap = (trainer_logprobs - sampled.sampler_logprobs)[mask].abs().max().item()
    weight_sync(start_snapshot)
    restored = engine_state_dict(engine)
    snapshot_mismatched = [n for n, p in start_weights.items() if not torch.equal(p, restored[n])]
    result = {"fresh_mismatched": fresh_mismatched, "mismatched": mismatched, "vllm_greedy": vllm_greedy, "hf_greedy": hf_greedy,
              "logprob_gap": gap, "snapshot_mismatched": snapshot_mismatched, "sync_bytes": stats.bytes, "changed": changed,
              "compiled_frames": counters["frames"]["total"], "sampler": engine.collective_rpc(sampler_name)[0]}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{roles.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1], sys.argv[2]))     # leaves without the interpreter's teardown, as the scripts do
