"""2 ranks (torchrun) for tests/test_tensor_parallel.py: `chosen_logprobs` of logits split over the vocabulary (a
DTensor, as a tensor-parallel head leaves them inside `vocab_parallel`) against the same logits whole: the chosen
tokens' logprobs, the entropies and the logits' gradients, for a vocabulary that does not split evenly, tokens on
both ranks' columns, rows picked several times and a temperature. Rank 0 prints one JSON line of the largest gaps.

    torchrun --standalone --nproc_per_node 2 tests/vocab_parallel_check.py
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from forge_core.dist import run_main
from forge_core.logprobs import chosen_logprobs


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    whole = (3 * torch.randn(24, 37, generator=g)).requires_grad_()
    rows = torch.randint(0, 24, (6, 9), generator=g)
    ids = torch.randint(0, 37, (6, 9), generator=g)
    weights = torch.randn(6, 9, generator=g)
    picked, entropy = chosen_logprobs(whole, rows, ids, 0.7, with_entropy=True)
    (picked * weights).sum().backward()

    split = distribute_tensor(whole.detach(), mesh, [Shard(1)]).requires_grad_()
    picked_split, entropy_split = chosen_logprobs(split, rows, ids, 0.7, with_entropy=True)
    (picked_split * weights).sum().backward()
    result = {"picked_gap": (picked - picked_split).abs().max().item(),
              "entropy_gap": (entropy - entropy_split).abs().max().item(),
              "grad_gap": (whole.grad - split.grad.full_tensor()).abs().max().item(),
              "ids_on_each_rank": bool((ids < 19).any() and (ids >= 19).any())}
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
