"""Log-probabilities of chosen tokens from a model's logits, a few rows at a time. The plain way
(`log_softmax(logits.float() / T)`, then pick) writes several float32 copies of the logits, [tokens, vocabulary]
each (190 MB for 1k tokens of a 49k vocabulary), in the forward and again in the backward; on CPU every fresh
copy of that size is also a fresh mapping of memory, paid in page faults. Here only the logits themselves
(the model's dtype) and their gradient are that large; the softmax is recomputed per chunk in the backward.
Logits whose vocabulary is split over tensor-parallel ranks (forge_core/tensor_parallel.py: loss parallel) stay
split: each rank computes its columns' share of each row's softmax and two all-reduces of [rows] numbers join them.
"""
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["chosen_logprobs"]

# float32 rows per chunk. CPU: a few MB, reused from the heap, not mapped anew; GPU: few kernel launches (a 152k
# vocabulary is 0.6 MB a row), a bounded share of the memory
_CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def chosen_logprobs(logits: Tensor, rows: Tensor, ids: Tensor, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits[r] / T)[i] for each (r, i) of `rows` x `ids` (any equal shapes; a row may be read many
    times), float32, differentiable in `logits` [M, V] (a tensor, or a DTensor split on V); and, if asked, the
    entropy of every row [M] (no grad)."""
    local, offset, group = _vocab_shard(logits) if isinstance(logits, DTensor) else (logits, 0, None)
    picked, entropy = _ChosenLogprobs.apply(local, rows.flatten(), ids.flatten(), temperature, with_entropy, offset,
                                            group)
    return picked.view(rows.shape), entropy if with_entropy else None


def _vocab_shard(logits: DTensor) -> tuple[Tensor, int, dist.ProcessGroup]:
    """This rank's columns of logits split over the vocabulary (the head's output sharded on its last dim), the
    first one's index in the whole vocabulary, and the ranks that hold the others."""
    [placement], mesh = logits.placements, logits.device_mesh
    assert isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1), placement
    _, (_, offset) = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    return logits.to_local(), offset, mesh.get_group()


def _chunks(logits: Tensor):
    step = max(1, _CHUNK_BYTES.get(logits.device.type, _CHUNK_BYTES["cuda"]) // (4 * logits.shape[1]))
    for start in range(0, logits.shape[0], step):
        yield start, min(start + step, logits.shape[0])


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """A float32 copy of some rows of logits, divided by T: free for in-place work."""
    z = logits.to(torch.float32, copy=True)
    return z if temperature == 1.0 else z.div_(temperature)


def _row_sums(logits: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """Per row of z = logits / T, over these columns: its max m [M], and sum(e) (and sum(e z)) [1 or 2, M] of
    e = exp(z - m), in one pass a chunk at a time."""
    top = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    sums = top.new_empty(1 + with_entropy, logits.shape[0])
    for a, b in _chunks(logits):
        z = _scaled(logits[a:b], temperature)
        top[a:b] = z.amax(-1)
        e = (z - top[a:b, None]).exp_()
        sums[0, a:b] = e.sum(-1)
        if with_entropy:
            sums[1, a:b] = (e[:, None, :] @ z[:, :, None])[:, 0, 0]
    return top, sums


class _ChosenLogprobs(torch.autograd.Function):
    """`group` None: logits whole. Otherwise columns `offset`.. of a vocabulary split over `group`'s ranks: each
    rank's maxima join by an all-reduce, then its rescaled sums and chosen tokens' logits (the rank holding a token
    gives its logit, the others 0) by another."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, ids: Tensor, temperature: float, with_entropy: bool, offset: int,
                group):
        top, sums = _row_sums(logits, temperature, with_entropy)
        mine = (ids >= offset) & (ids < offset + logits.shape[1])
        ids = torch.where(mine, ids - offset, 0)
        chosen = torch.where(mine, logits[rows, ids].float() / temperature, 0.0)
        if group is not None:
            whole_top = top.clone()
            dist.all_reduce(whole_top, dist.ReduceOp.MAX, group=group)
            joined = torch.cat([(sums * (top - whole_top).exp()).flatten(), chosen])
            dist.all_reduce(joined, group=group)
            top, sums, chosen = whole_top, joined[:sums.numel()].view(sums.shape), joined[sums.numel():]
        lse = top + sums[0].log()
        entropy = lse - sums[1] / sums[0] if with_entropy else lse.new_empty(0)     # H = lse - sum(p z)
        ctx.save_for_backward(logits, rows, ids, mine, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return chosen - lse[rows], entropy

    @staticmethod
    def backward(ctx, grad_picked: Tensor, _grad_entropy: Tensor):
        logits, rows, ids, mine, lse = ctx.saved_tensors
        return (_logits_grad(logits, rows, ids[mine], lse, grad_picked, mine, ctx.temperature),
                None, None, None, None, None, None)


def _logits_grad(logits: Tensor, rows: Tensor, ids: Tensor, lse: Tensor, grad_picked: Tensor, here: Tensor,
                 temperature: float) -> Tensor:
    """d picked(r, i) / d logits[r] = (onehot(i) - softmax(logits[r] / T)) / T, summed over the picks: the softmax
    part for every pick, the one-hot part for those whose token is among these columns (`here`; `ids` their
    columns). Split over a vocabulary, every rank has the whole `grad_picked` (the loss is computed alike on each)."""
    per_row = torch.zeros_like(lse).index_add_(0, rows, grad_picked.float())    # [M] sum of grads per row
    on_rows, on_grads = rows[here], grad_picked[here]
    grad = torch.empty_like(logits)
    for a, b in _chunks(logits):
        g = _scaled(logits[a:b], temperature).sub_(lse[a:b, None]).exp_().mul_(-per_row[a:b, None])
        inside = (on_rows >= a) & (on_rows < b)
        g.index_put_((on_rows[inside] - a, ids[inside]), on_grads[inside].float(), accumulate=True)
        grad[a:b] = g if temperature == 1.0 else g.div_(temperature)
    return grad
