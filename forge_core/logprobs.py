"""Log-probabilities of chosen tokens from a model's logits, a few rows at a time. The plain way
(`log_softmax(logits.float() / T)`, then pick) writes several float32 copies of the logits, [tokens, vocabulary]
each (190 MB for 1k tokens of a 49k vocabulary), in the forward and again in the backward; on CPU every fresh
copy of that size is also a fresh mapping of memory, paid in page faults. Here only the logits themselves
(the model's dtype) and their gradient are that large; the softmax is recomputed per chunk in the backward.
Logits whose vocabulary is split over tensor-parallel ranks (forge_core/tensor_parallel.py: loss parallel) stay
split: each rank computes its columns' share of each row's softmax and three all-reduces of [rows] numbers join them.
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
    if isinstance(logits, DTensor):
        picked, entropy = _vocab_parallel(logits, rows.flatten(), ids.flatten(), temperature, with_entropy)
    else:
        picked, entropy = _ChosenLogprobs.apply(logits, rows.flatten(), ids.flatten(), temperature, with_entropy)
    return picked.view(rows.shape), entropy if with_entropy else None


def _chunks(logits: Tensor):
    step = max(1, _CHUNK_BYTES.get(logits.device.type, _CHUNK_BYTES["cuda"]) // (4 * logits.shape[1]))
    for start in range(0, logits.shape[0], step):
        yield start, min(start + step, logits.shape[0])


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """A float32 copy of some rows of logits, divided by T: free for in-place work."""
    z = logits.to(torch.float32, copy=True)
    return z if temperature == 1.0 else z.div_(temperature)


class _ChosenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, ids: Tensor, temperature: float, with_entropy: bool):
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for a, b in _chunks(logits):
            z = _scaled(logits[a:b], temperature)
            top = z.amax(-1, keepdim=True)
            e = (z - top).exp_()
            total = e.sum(-1)
            lse[a:b] = top[:, 0] + total.log()
            if with_entropy:                 # H = lse - sum(p z), p = e / total
                entropy[a:b] = lse[a:b] - (e[:, None, :] @ z[:, :, None])[:, 0, 0] / total
        picked = logits[rows, ids].float() / temperature - lse[rows]
        ctx.save_for_backward(logits, rows, ids, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked: Tensor, _grad_entropy: Tensor):
        logits, rows, ids, lse = ctx.saved_tensors
        return _logits_grad(logits, rows, ids, lse, grad_picked, None, ctx.temperature), None, None, None, None


def _logits_grad(logits: Tensor, rows: Tensor, ids: Tensor, lse: Tensor, grad_picked: Tensor, here: Tensor | None,
                 temperature: float) -> Tensor:
    """d picked(r, i) / d logits[r] = (onehot(i) - softmax(logits[r] / T)) / T, summed over the picks; `here`: the
    picks whose token is among these columns (None: all), `ids` their columns."""
    per_row = torch.zeros_like(lse).index_add_(0, rows, grad_picked.float())    # [M] sum of grads per row
    on_rows, on_grads = (rows, grad_picked) if here is None else (rows[here], grad_picked[here])
    grad = torch.empty_like(logits)
    for a, b in _chunks(logits):
        g = _scaled(logits[a:b], temperature).sub_(lse[a:b, None]).exp_().mul_(-per_row[a:b, None])
        inside = (on_rows >= a) & (on_rows < b)
        g.index_put_((on_rows[inside] - a, ids[inside]), on_grads[inside].float(), accumulate=True)
        grad[a:b] = g if temperature == 1.0 else g.div_(temperature)
    return grad

def _vocab_parallel(logits: DTensor, rows: Tensor, ids: Tensor, temperature: float, with_entropy: bool):
    """The same for logits whose vocabulary is split over tensor-parallel ranks (the head's output sharded on its
    last dim, never gathered): each rank's softmax pieces are summed over the ranks by three all-reduces."""
    [placement], mesh = logits.placements, logits.device_mesh
    assert isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1), placement
    _, (_, offset) = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    return _VocabParallelLogprobs.apply(logits.to_local(), rows, ids, temperature, with_entropy, offset,
                                        mesh.get_group())


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, ids: Tensor, temperature: float, with_entropy: bool, offset: int,
                group):
        top = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for a, b in _chunks(logits):
            top[a:b] = _scaled(logits[a:b], temperature).amax(-1)
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(2 if with_entropy else 1, logits.shape[0], dtype=torch.float32, device=logits.device)
        for a, b in _chunks(logits):
            z = _scaled(logits[a:b], temperature)
            e = (z - top[a:b, None]).exp_()
            sums[0, a:b] = e.sum(-1)
            if with_entropy:            # sum e z: H = lse - sum(p z)
                sums[1, a:b] = (e[:, None, :] @ z[:, :, None])[:, 0, 0]
        mine = (ids >= offset) & (ids < offset + logits.shape[1])
        local = torch.where(mine, ids - offset, 0)
        picked = torch.where(mine, logits[rows, local].float() / temperature, 0.0)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(picked, group=group)
        lse = top + sums[0].log()
        entropy = lse - sums[1] / sums[0] if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(logits, rows, local, mine, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return picked - lse[rows], entropy

    @staticmethod
    def backward(ctx, grad_picked: Tensor, _grad_entropy: Tensor):
        """This rank's columns of (onehot(i) - softmax(logits[r] / T)) / T, summed over the picks: every rank has
        the whole `grad_picked` (the loss is computed alike on each)."""
        logits, rows, local, mine, lse = ctx.saved_tensors
        return (_logits_grad(logits, rows, local[mine], lse, grad_picked, mine, ctx.temperature),
                None, None, None, None, None, None)
