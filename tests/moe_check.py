"""2 ranks (torchrun) for tests/test_moe.py: a tiny Qwen3-MoE FSDP-sharded over both ranks (3 experts: one rank holds
2, the other 1) against the same model whole in one process. Each rank's batch (padded rows) gets the language-model
loss plus `Routers`' load-balancing loss (forge_core/moe.py, weight 0.1); the one-process model computes the same
sum over both ranks' batches with transformers' own `load_balancing_loss_func` from the router logits it returns.
Rank 0 prints one JSON line: the largest difference of the balance losses, and of the gradients (experts, router and
all) relative to the largest gradient, and the experts' load the routers counted against a count from transformers'
router logits.

    torchrun --standalone --nproc_per_node 2 tests/moe_check.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from forge_core.dist import run_main
from forge_core.model import FSDPConfig, ModelConfig
from forge_core.moe import Routers
from forge_core.weights import build_model

CONFIG = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=3,
                        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
WEIGHT = 0.1


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's 3 rows of 12 tokens, the last row padded on the left by 4."""
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    mask[-1, :4] = 0
    return ids, mask


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = out / "moe"
    if rank == 0:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(CONFIG).save_pretrained(path)
    dist.barrier()
    sharded = build_model(ModelConfig(path=str(path)), init_device_mesh("cpu", (world,)), FSDPConfig())
    routers = Routers(sharded, WEIGHT)
    ids, mask = batch(rank)
    logits = sharded(input_ids=ids, attention_mask=mask).logits
    mine = routers.loss() / WEIGHT
    (lm_loss(logits, ids, mask) + WEIGHT * mine).backward()   # FSDP averages the ranks' gradients
    load = routers.counts.clone()
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}

    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    total, balances, counts = 0.0, [], torch.zeros_like(load)
    for r in range(world):
        ids, mask = batch(r)
        out_r = whole(input_ids=ids, attention_mask=mask, output_router_logits=True)
        balance = load_balancing_loss_func(out_r.router_logits, CONFIG.num_experts, CONFIG.num_experts_per_tok, mask)
        total = total + (lm_loss(out_r.logits, ids, mask) + WEIGHT * balance) / world
        balances.append(balance.item())
        if r == rank:
            real = mask.flatten().bool()
            for layer, layer_logits in enumerate(out_r.router_logits):
                chosen = layer_logits[real].topk(CONFIG.num_experts_per_tok, dim=-1).indices.flatten()
                counts[layer] = torch.bincount(chosen, minlength=CONFIG.num_experts).double()
    total.backward()
    expected = {n: p.grad for n, p in whole.named_parameters()}
    scale = max(g.abs().max().item() for g in expected.values())
    gap = max((grads[n] - expected[n]).abs().max().item() for n in expected) / scale
    result = {"balance_gap": abs(mine.item() - balances[rank]), "grad_gap": gap, "load_equal": torch.equal(load, counts),
              "expert_grads_nonzero": all(grads[n].abs().sum().item() > 0 for n in grads if "experts" in n),
              "grads_compared": len(expected)}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print(json.dumps({k: max(g[k] for g in gathered) if isinstance(result[k], float) else all(g[k] for g in gathered)
                          if isinstance(result[k], bool) else result[k] for k in result}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(lambda: main(Path(sys.argv[1])))
