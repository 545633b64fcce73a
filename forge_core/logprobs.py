"""Log-probabilities of chosen tokens from a model's logits, a few rows at a time. The plain way
(`log_softmax(logits.float() / T)`, then pick) writes several float32 copies of the logits, [tokens, vocabulary]
each (190 MB for 1k tokens of a 49k vocabulary), in the forward and again in the backward; on CPU every fresh
copy of that size is also a fresh mapping of memory, paid in page faults. Here only the logits themselves
(the model's dtype) and their gradient are that large; the softmax is recomputed per chunk in the backward."""
import torch
from torch import Tensor

__all__ = ["chosen_logprobs"]

# float32 rows per chunk. CPU: a few MB, reused from the heap, not mapped anew; GPU: few kernel launches (a 152k
# vocabulary is 0.6 MB a row), a bounded share of the memory
_CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def chosen_logprobs(logits: Tensor, rows: Tensor, ids: Tensor, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits[r] / T)[i] for each (r, i) of `rows` x `ids` (any equal shapes; a row may be read many
    times), float32, differentiable in `logits` [M, V]; and, if asked, the entropy of every row [M] (no grad)."""
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
        """d picked(r, i) / d logits[r] = (onehot(i) - softmax(logits[r] / T)) / T, summed over the picks."""
        logits, rows, ids, lse = ctx.saved_tensors
        per_row = torch.zeros_like(lse).index_add_(0, rows, grad_picked.float())    # [M] sum of grads per row
        grad = torch.empty_like(logits)
        for a, b in _chunks(logits):
            g = _scaled(logits[a:b], ctx.temperature).sub_(lse[a:b, None]).exp_().mul_(-per_row[a:b, None])
            here = (rows >= a) & (rows < b)
            g.index_put_((rows[here] - a, ids[here]), grad_picked[here].float(), accumulate=True)
            grad[a:b] = g if ctx.temperature == 1.0 else g.div_(ctx.temperature)
        return grad, None, None, None, None
