"""2 ranks (torchrun): a model built on the meta device and filled by each rank's own slices of the safetensors
files equals a full load bit for bit (every weight, the rotary buffers, the logits), for untied Llama, tied Llama,
Qwen3 and Qwen3-MoE (fused experts in the trainer, one tensor per expert in the files), sharded and replicated (`fsdp.shard: false`: plain modules, a tied head still the embedding); its export streams into an HF directory that loads back identical, also split over several files.

    torchrun --nproc_per_node 2 tests/load_check.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from forge_core.dist import run_main
from forge_core.model import FSDPConfig, ModelConfig, shard
from forge_core.weights import build_model, export_hf, hf_tensors

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {"llama": LlamaConfig(**SHAPE, tie_word_embeddings=False),
           "llama_tied": LlamaConfig(**SHAPE, tie_word_embeddings=True),
           "qwen3": Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True),
           # 3 experts over 2 ranks: FSDP gives one rank 2, the other 1; files hold one tensor per expert
           "qwen3_moe": Qwen3MoeConfig(**SHAPE, head_dim=16, tie_word_embeddings=True, num_experts=3,
                                       num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = torch.arange(40).view(2, 20) % 96
    for name, config in CONFIGS.items():
        path = out / name
        if rank == 0:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
        dist.barrier()
        full = shard(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mesh, FSDPConfig())
        sharded = build_model(ModelConfig(path=str(path)), mesh, FSDPConfig())
        expected, got = dict(hf_tensors(full)), dict(hf_tensors(sharded))
        assert expected.keys() == set(safe_open(path / "model.safetensors", "pt").keys()) | (
            {"lm_head.weight"} if config.tie_word_embeddings else set()), name   # the files' names
        assert expected.keys() == got.keys(), (name, expected.keys() ^ got.keys())
        for key in expected:
            assert torch.equal(expected[key], got[key]), (name, key)
        for (key, a), b in zip(full.named_buffers(), sharded.buffers()):
            assert torch.equal(a, b), (name, key)
        with torch.no_grad():
            assert torch.equal(full(tokens).logits, sharded(tokens).logits), name
        for shard_bytes in (2 ** 30, 40_000):     # one file; several files and an index
            export = out / f"{name}_export_{shard_bytes}"
            export_hf(sharded, None, export, shard_bytes=shard_bytes)
            if rank == 0:
                back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
                files = sorted(p.name for p in export.glob("*.safetensors"))
                assert (len(files) > 1) == (shard_bytes < 2 ** 30), files
                for key, t in dict(hf_tensors(back)).items():
                    assert torch.equal(t, expected[key]), (name, shard_bytes, key)
        replicated = build_model(ModelConfig(path=str(path)), mesh, FSDPConfig(shard=False))   # unsharded modules
        if config.tie_word_embeddings:
            assert sharded.lm_head.weight is sharded.model.embed_tokens.weight, name
            assert replicated.lm_head.weight is replicated.model.embed_tokens.weight, name
        with torch.no_grad():
            assert torch.equal(full(tokens).logits, replicated(tokens).logits), name
        if rank == 0:
            print(f"{name}: sharded load == full load, exports load back equal", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(lambda: main(Path(sys.argv[1])))
