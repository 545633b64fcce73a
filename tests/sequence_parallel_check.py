"""2 ranks (torchrun) for tests/test_tensor_parallel.py: `tensor_parallel.parallelize`'s plan, sequence parallelism
included, against the same model in one process: a tiny Qwen3 and a tiny Qwen3-MoE (experts whole on each rank),
forward and backward on 13 positions (odd: the ranks hold 7 and 6 of them) and on 1 (a decode step: one rank holds
none). Rank 0 prints one JSON line: the largest logit gap and relative gradient gap, and how the residual stream
between the layers is laid out.

    torchrun --standalone --nproc_per_node 2 tests/sequence_parallel_check.py
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from forge_core.dist import run_main
from forge_core.tensor_parallel import parallelize
from forge_core.weights import full_tensor

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
MODELS = {"qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE)),
          "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                            moe_intermediate_size=16))}


def compare(name: str, mesh) -> dict:
    cls, config = MODELS[name]
    torch.manual_seed(0)
    one = cls(config)
    split = cls(config)
    split.load_state_dict(one.state_dict())
    parallelize(split, mesh)
    streams = []
    split.model.layers[0].register_forward_hook(lambda module, args, out: streams.append(_layout(out)))
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    logit_gap, grad_gap = 0.0, 0.0
    for positions in (13, 1):
        one.zero_grad(), split.zero_grad()
        logits, split_logits = one(input_ids=ids[:, :positions]).logits, split(input_ids=ids[:, :positions]).logits
        (logits ** 2).sum().backward(), (split_logits ** 2).sum().backward()
        logit_gap = max(logit_gap, (logits - split_logits).abs().max().item())
        grads = {n: p.grad for n, p in split.named_parameters()}
        grad_gap = max(grad_gap, *(((p.grad - full_tensor(grads[n])).abs().max() / p.grad.abs().max()).item()
                                   for n, p in one.named_parameters()))
    return {"logit_gap": logit_gap, "relative_grad_gap": grad_gap, "residual_stream": streams}


def _layout(t) -> list:
    return [str(t.placements[0]), t.to_local().shape[1]] if isinstance(t, DTensor) else ["whole", t.shape[1]]


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {name: compare(name, mesh) for name in MODELS}
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
