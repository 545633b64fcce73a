"""Distributed checkpoints (torch DCP) that a crash or `kill -9` at any moment cannot corrupt.

Layout under `<out_dir>/checkpoints/`: `step_000040/` holds the DCP shards of model + optimizer, one
`rng_rank{r}.pt` per rank and `meta.json` (step, scheduler, data position, ...). A checkpoint is written as
`step_000040.tmp/` and renamed only when complete, so a directory without `.tmp` is always loadable.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .config import ForgeError

__all__ = ["CheckpointConfig", "Checkpointer", "publish_dir"]


@dataclass
class CheckpointConfig:
    save_every: int = 0                 # steps between checkpoints; 0 = only the final one
    keep_last: int = 2                  # older checkpoints are deleted
    resume: str = "auto"                # "auto": latest in out_dir if any; "never"; or a checkpoint directory
    export_every: int = 0               # also export HF safetensors every N steps; 0 = only at the end


class Checkpointer:
    def __init__(self, out_dir: str | Path, cfg: CheckpointConfig, group: dist.ProcessGroup | None = None):
        self.root = Path(out_dir) / "checkpoints"
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank()

    def resume_path(self) -> Path | None:
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if not (path / "meta.json").is_file():
                raise ForgeError(f"checkpoint error: ckpt.resume '{path}': not a complete checkpoint "
                                 "(no meta.json)")
            return path
        done = sorted(self.root.glob("step_*[0-9]")) if self.root.is_dir() else []
        done = [p for p in done if (p / "meta.json").is_file()]
        return done[-1] if done else None

    def maybe_save(self, step: int, total_steps: int, model, optim, meta: dict[str, Any]) -> Path | None:
        if step == total_steps or (self.cfg.save_every and step % self.cfg.save_every == 0):
            return self.save(step, model, optim, meta)
        return None

    def save(self, step: int, model, optim, meta: dict[str, Any]) -> Path:
        """Collective over `group`: DCP shards + per-rank RNG into a tmp dir, then one atomic rename."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), process_group=self.group)
        torch.save(_rng_state(), tmp / f"rng_rank{self.rank}.pt")
        dist.barrier(group=self.group)
        if self.rank == 0:
            (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
            publish_dir(tmp, final)
            self._prune()
        dist.barrier(group=self.group)
        return final

    def load(self, path: Path, model, optim) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG in place; returns meta.json (step, scheduler, ...)."""
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():    # a run restarted with another world size keeps its fresh RNG
            _set_rng_state(torch.load(rng_file, weights_only=True))
        return json.loads((path / "meta.json").read_text())

    def _prune(self) -> None:
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        done = sorted(p for p in self.root.glob("step_*[0-9]") if (p / "meta.json").is_file())
        for old in done[:-self.cfg.keep_last] if self.cfg.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete directory `tmp` appear as `final`; an old `final` survives until the swap."""
    _fsync_tree(tmp)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync(final.parent)


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        _fsync(file)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
