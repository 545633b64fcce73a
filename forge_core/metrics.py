"""Rank-0 output in one place: a console progress line, TensorBoard scalars and a JSONL file.

`MetricLogger(out_dir, enabled=rank == 0)` is a no-op on the other ranks; `reduce_metrics` is the one
cross-rank reduction that every rank calls before logging (`rollout_metrics`: a GRPO step's).
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from .rollout import Rollout

__all__ = ["MetricLogger", "reduce_metrics", "reduce_sum", "rollout_metrics", "peak_memory_gb"]


class MetricLogger:
    def __init__(self, out_dir: str | Path, total_steps: int, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.total_steps = total_steps
        self._start_step = start_step
        self._start_time = time.perf_counter()
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = SummaryWriter(str(self.out_dir / "tb"))

    def log(self, step: int, metrics: dict[str, float], console_keys: tuple[str, ...] = ()) -> None:
        """Write `metrics` for `step` (1-based, steps done so far) everywhere; print the chosen keys + ETA."""
        if not self.enabled:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        shown = "  ".join(f"{k.removeprefix('train/')} {_fmt(metrics[k])}" for k in console_keys if k in metrics)
        print(f"step {step}/{self.total_steps}  {shown}  eta {self._eta(step)}", flush=True)

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()

    def _eta(self, step: int) -> str:
        done = step - self._start_step
        if done <= 0:
            return "?"
        seconds = (time.perf_counter() - self._start_time) / done * (self.total_steps - step)
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def reduce_metrics(sums: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum every value over `group` (callers divide by counts they also summed): one all-reduce, on the GPU
    where the group is NCCL's (it has no CPU tensors)."""
    if not sums:
        return {}
    keys = sorted(sums)
    return dict(zip(keys, reduce_sum(torch.tensor([float(sums[k]) for k in keys]), group).tolist()))


def reduce_sum(values: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """A CPU tensor summed over `group`, in float64 (on the GPU where the group is NCCL's), back on CPU."""
    if not dist.is_initialized():
        return values.double()
    nccl = "nccl" in str(dist.get_backend(group))
    values = values.to("cuda" if nccl else "cpu", torch.float64)
    dist.all_reduce(values, group=group)
    return values.cpu()


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated by torch, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20    # ru_maxrss is in KiB on Linux


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}"


def rollout_metrics(rollout: Rollout, group: dist.ProcessGroup, accuracy_fn: str) -> dict[str, float]:
    """A GRPO step's rewards (their terms, errors and timeouts), completions and episodes, over all policy ranks
    (`group`); `accuracy_fn`'s mean is `reward/accuracy`."""
    r = rollout.rewards
    sums = {"n": len(rollout), "r": r.sum().item(), "r2": (r ** 2).sum().item(),
            "errors": rollout.reward_errors.sum().item(), "timeouts": rollout.reward_timeouts.sum().item(),
            "len": rollout.completion_mask.sum().item(), "trunc": rollout.truncated.sum().item(),
            "dropped": 0.0 if rollout.kept is None else (~rollout.kept).sum().item(),
            **{f"term/{k}": v.sum().item() for k, v in rollout.reward_terms.items()},
            **{f"episode/{k}": v.sum().item() for k, v in rollout.episode.items()}}
    s = reduce_metrics(sums, group)
    mean = s["r"] / s["n"]
    out = {"reward/mean": mean, "reward/std": math.sqrt(max(s["r2"] / s["n"] - mean ** 2, 0.0)),
           "reward/errors": s["errors"], "reward/timeouts": s["timeouts"],
           "reward/accuracy": s.get(f"term/{accuracy_fn}", 0.0) / s["n"],
           "completion/length": s["len"] / s["n"], "completion/truncated": s["trunc"] / s["n"],
           "train/dropped_sequences": s["dropped"] / s["n"]}
    return out | {f"reward/{k[5:]}": v / s["n"] for k, v in s.items() if k.startswith("term/")} | \
        {k: v / s["n"] for k, v in s.items() if k.startswith("episode/")}
