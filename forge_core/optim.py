"""The optimizer and its step: AdamW with warm-up and cosine decay, DDP's gradient averaging for replicated
ranks (flat buckets), clipping, and the guard that skips a non-finite update (`BadSteps` counts them)."""

import math
from dataclasses import dataclass
from typing import Annotated, Callable

import torch
import torch.distributed as dist
from annotated_types import Interval
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from .config import ForgeError

__all__ = ["OptimConfig", "build_optimizer", "optimizer_step", "BadSteps"]

GRADIENT_BUCKET_BYTES = 25 * 2**20     # replicated ranks all-reduce gradients in buckets of this size, as DDP's default


Beta = Annotated[float, Interval(ge=0, lt=1)]


@dataclass
class OptimConfig:
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: Annotated[float, Interval(ge=0, le=1)] = 0.1   # cosine decays to lr * min_lr_ratio at the last step
    max_grad_norm: NonNegativeFloat = 1.0   # 0 disables clipping


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int):
    """AdamW (no decay on norms and biases) and a linear warm-up + cosine decay schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    # a group per mesh too: the fused kernel takes no mix of them (tensor parallelism leaves two)
    groups = [{"params": same_mesh, "weight_decay": weight_decay}
              for params, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
              for same_mesh in _by_mesh(params).values()]
    optim = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=True)   # one kernel a group, CPU and CUDA

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return optim, torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)


def optimizer_step(model: nn.Module, optim, sched, max_grad_norm: float) -> float:
    """Clip (if asked), step, advance the schedule, zero the grads; returns the pre-clip gradient norm.

    A non-finite norm (NaN or inf in a gradient, as a non-finite loss gives) skips the update: weights and
    Adam's moments stay as they were, the schedule advances as it would have, and the caller counts the skip
    (`BadSteps`). An update that leaves the weights non-finite (or so large that their norm overflows) ends
    the run before a sync, checkpoint or export carries them. Both norms are global over FSDP's shards, so
    every rank decides the same."""
    params = [p for p in model.parameters() if p.grad is not None]
    if (replicas := getattr(model, "replica_group", None)) is not None:
        _average_gradients(params, replicas)
    norm = _total_norm([p.grad for p in params])
    if max_grad_norm > 0:
        for same_mesh in _by_mesh(params).values():
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_grad_norm, torch.tensor(norm))
    if math.isfinite(norm):
        optim.step()
        if not math.isfinite(weights := _total_norm([p.detach() for p in params])):
            raise ForgeError(f"training error: an update at lr {sched.get_last_lr()[0]:.3g} took the weights out of "
                             f"float range (their norm is {weights}); lower optim.lr")
    sched.step()
    optim.zero_grad(set_to_none=True)
    return norm


def _average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """DDP's step: the replicas' gradients summed, in flat buckets of `GRADIENT_BUCKET_BYTES` as DDP's own (one
    gloo all-reduce per tensor cost 4x one per bucket at the tiny model's 38 tensors), then divided by the
    ranks, as FSDP's reduce-scatter averages. One bucket is flattened while the last one is reduced: the
    copies cost two buckets of memory, not the model's gradients again."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    ranks = dist.get_world_size(group)
    in_flight: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
    for bucket in _buckets(grads, GRADIENT_BUCKET_BYTES):
        flat = _flatten_dense_tensors(bucket)
        in_flight.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
        if len(in_flight) == 2:
            _unflatten_mean(*in_flight.pop(0), ranks)
    for item in in_flight:
        _unflatten_mean(*item, ranks)


def _unflatten_mean(bucket: list[torch.Tensor], flat: torch.Tensor, work: dist.Work, ranks: int) -> None:
    work.wait()
    flat.div_(ranks)
    torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype up to max_bytes each (a larger tensor is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or t.dtype != buckets[-1][0].dtype or size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def _total_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of all `tensors` together, each whole (a DTensor's over its mesh). A tensor-parallel model holds
    DTensors on two meshes (its layers' on dp x tp, the rest on dp, or plain tensors): a norm per mesh, then theirs."""
    norms = [torch.nn.utils.get_total_norm(group) for group in _by_mesh(tensors).values()]
    return math.sqrt(sum((n.full_tensor() if isinstance(n, DTensor) else n).item() ** 2 for n in norms))


def _by_mesh(tensors: list[torch.Tensor]) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return groups


@dataclass
class BadSteps:
    """Steps whose update `optimizer_step` skipped (non-finite loss or gradient norm): each one is printed
    and counted, and `limit` in a row end the run, which then has nothing left to learn from."""
    limit: int                          # train.max_bad_steps
    warn: Callable[[str], None]         # MetricLogger.print
    in_a_row: int = 0
    total: int = 0                      # in this run (since start or resume): the `train/skipped_steps` metric

    def count(self, step: int, grad_norm: float) -> None:
        if math.isfinite(grad_norm):
            self.in_a_row = 0
            return
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        self.warn(f"step {step}: update skipped, gradient norm {grad_norm} ({self.in_a_row} in a row)")
        if self.in_a_row >= self.limit:
            raise ForgeError(f"training error: {self.in_a_row} steps in a row, up to step {step}, had a non-finite "
                             f"loss or gradient norm (train.max_bad_steps={self.limit}); their updates were skipped")
