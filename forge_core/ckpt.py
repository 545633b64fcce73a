"""Distributed checkpoints (torch DCP) that neither a crash, `kill -9` nor a damaged disk can cost a run.

Layout under `<out_dir>/checkpoints/`: `step_000040/` holds the DCP shards of model + optimizer, one
`rng_rank{r}.pt` per rank (and `state_rank{r}.pt` where a script keeps a rank's own state, such as GRPO's rollout
in flight), `meta.json` (step, scheduler, data position, ...) and, written last, `manifest.json`
(every file's size and sha256). It is written as `step_000040.tmp/` and renamed when complete: the rename makes
it appear whole, the manifest proves its bytes. Resume names a damaged one's file and falls back past it.

A checkpoint can also be asked for: when the file named by $FORGE_CHECKPOINT_REQUEST appears (slurm/launch.sh
creates it on SLURM's warning before the time limit, `#SBATCH --signal=B:USR1@300`), the ranks save at the end
of the step they are in, and under SLURM rank 0 then requeues the job, which resumes from that checkpoint.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .config import ForgeError

__all__ = ["CheckpointConfig", "Checkpointer", "export_path", "finished_message", "finished_run", "first_on_any_rank",
           "publish_dir", "verify_checkpoint", "MANIFEST"]

MANIFEST = "manifest.json"


@dataclass
class CheckpointConfig:
    save_every: int = 0                 # steps between checkpoints; 0 = only the final one
    keep_last: int = 2                  # older checkpoints are deleted; >= 2 leaves one to fall back to
    resume: str = "auto"                # "auto": the newest intact one in out_dir, if any; "never"; or a directory
    export_every: int = 0               # also export HF safetensors (<out_dir>/hf_step_N) every N steps; 0 = never


class Checkpointer:
    """Saves, verifies and loads checkpoints; every method is collective over `group` (None = the world)."""

    def __init__(self, out_dir: str | Path, cfg: CheckpointConfig, group: dist.ProcessGroup | None = None):
        self.root = Path(out_dir) / "checkpoints"
        self.cfg = cfg
        self.group = group
        self.rank = dist.get_rank()
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.request = os.environ.get("FORGE_CHECKPOINT_REQUEST")     # the same on every rank (srun passes it on)
        self._answering = False         # the checkpoint `due` found is the one asked for

    def resume_path(self, model_path: str) -> Path | None:
        """The checkpoint to resume from, checked against its manifest; the same answer on every rank. One found
        in out_dir (`resume: auto`) must come from a run that started from `model_path`: a run of another model
        in the same out_dir would have gone on with that run's weights, without a word."""
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume != "auto":
            path = Path(self.cfg.resume)
            if (problem := self._verify(path)) is not None:
                raise ForgeError(f"checkpoint error: ckpt.resume '{path}': {problem}")
            return path
        damaged = []
        for path in reversed(self._all_gather(_step_dirs(self.root))[0]):    # rank 0's list: the same on all
            if (problem := self._verify(path)) is None:
                _check_started_from(path, model_path)
                return path
            damaged.append(f"{path.name}: {problem}")
            if self.group_rank == 0:
                print(f"checkpoint {path} is damaged ({problem}); trying the one before it", file=sys.stderr)
        if damaged:
            raise ForgeError(f"checkpoint error: no intact checkpoint in {self.root} ({'; '.join(damaged)}); "
                             "move them away to start fresh, or name one with --ckpt.resume")
        return None

    def maybe_save(self, step: int, total_steps: int, model, optim, meta: dict[str, Any]) -> Path | None:
        return self.save_due(step, model, optim, meta) if self.due(step, total_steps) else None

    def due(self, step: int, total_steps: int) -> bool:
        """Whether a checkpoint is saved at the end of `step` (the last, every `save_every`, or asked for); ask
        before work that must precede it (GRPO syncs its engines first), then `save_due`."""
        self._answering = self._requested()
        return self._answering or step == total_steps or bool(self.cfg.save_every and step % self.cfg.save_every == 0)

    def save_due(self, step: int, model, optim, meta: dict[str, Any], rank_state: dict | None = None) -> Path:
        path = self.save(step, model, optim, meta, rank_state)
        if self._answering and self.group_rank == 0:
            _answer_request(self.request, path)
        return path

    def _requested(self) -> bool:
        """Whether the request file exists, as group rank 0 sees it (on a shared disk, so any rank could look)."""
        if self.request is None:
            return False
        return self._all_gather(self.group_rank == 0 and os.path.exists(self.request))[0]

    def save(self, step: int, model, optim, meta: dict[str, Any], rank_state: dict | None = None) -> Path:
        """DCP shards, per-rank RNG and meta.json into a tmp dir; every rank checksums its share of the files;
        the manifest last; one atomic rename. A failed write (disk full, file too large) is the same
        ForgeError on every rank, with the tmp dir removed and older checkpoints untouched."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.group_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=self.group)
        self._settle(final, tmp, self._attempt(self._write_state, tmp, step, model, optim, meta, rank_state))
        names = self._all_gather(sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file()))[0]   # rank 0's
        mine = {name: _file_entry(tmp / name) for name in names[self.group_rank::self.group_size]}
        files = dict(sorted(kv for part in self._all_gather(mine) for kv in part.items()))
        self._settle(final, tmp, self._attempt(self._publish, tmp, final, files) if self.group_rank == 0 else None)
        return final

    def load(self, path: Path, model, optim, train_steps: int | None = None) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG in place; returns meta.json (step, scheduler, ...).
        A checkpoint past `train_steps` (a finished run's directory, run again with fewer steps) is an error."""
        meta = json.loads((path / "meta.json").read_text())
        if train_steps is not None and meta["step"] > train_steps:
            raise ForgeError(f"config error: train.steps={train_steps} ends before the step-{meta['step']} checkpoint "
                             f"it would resume from ({path}): raise train.steps, or use another out_dir")
        model_sd, optim_sd = _trained_state(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))   # frozen: not saved
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():    # a run restarted with another world size keeps its fresh RNG
            _set_rng_state(torch.load(rng_file, weights_only=True))
        return meta

    def rank_state(self, path: Path) -> dict | None:
        """This rank's own state saved with the checkpoint (`save(rank_state=...)`), None if it saved none."""
        file = path / f"state_rank{self.rank}.pt"
        return torch.load(file, weights_only=True) if file.is_file() else None

    def _write_state(self, tmp: Path, step: int, model, optim, meta: dict[str, Any], rank_state: dict | None) -> None:
        model_sd, optim_sd = _trained_state(model, optim)
        writer = _Writer(tmp)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer, process_group=self.group)
        except CheckpointException as err:
            raise writer.os_error or err
        torch.save(_rng_state(), tmp / f"rng_rank{self.rank}.pt")
        if rank_state is not None:
            torch.save(rank_state, tmp / f"state_rank{self.rank}.pt")
        if self.group_rank == 0:
            (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))

    def _publish(self, tmp: Path, final: Path, files: dict[str, dict]) -> None:
        (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        publish_dir(tmp, final)
        self._prune(final)

    def _attempt(self, write: Callable[..., None], *args: Any) -> str | None:
        """Run a write; its failure (here, or through DCP on any rank) comes back as "on rank R: <error>"."""
        try:
            write(*args)
        except CheckpointException as err:    # another rank's failure, which DCP raises on every rank
            rank, (cause, _) = next(iter(err.failures.items()))
            return f"on rank {rank}: {type(cause).__name__}: {cause}"
        except OSError as err:
            return f"on rank {self.group_rank}: {err}"
        return None

    def _settle(self, final: Path, tmp: Path, error: str | None) -> None:
        """Every rank learns whether any rank's write failed; if one did, all raise the same ForgeError."""
        error = first_on_any_rank(error, self.group)
        if error is None:
            return
        if self.group_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=self.group)    # torchrun stops every worker once one exits: clean up first
        older = [p.name for p in _step_dirs(self.root) if p.name < final.name and (p / MANIFEST).is_file()]
        kept = f"the previous checkpoint {older[-1]} is untouched" if older else "there is no earlier checkpoint"
        raise ForgeError(f"checkpoint error: writing {final.name} failed {error}; {kept}")

    def _verify(self, path: Path) -> str | None:
        """`verify_checkpoint` with the reading split over the ranks; the first problem found, on every rank."""
        return first_on_any_rank(verify_checkpoint(path, self.group_rank, self.group_size), self.group)

    def _prune(self, newest: Path) -> None:
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        # Newer checkpoints are left from before a fall-back past a damaged one: they neither count nor go.
        done = [p for p in _step_dirs(self.root) if p.name <= newest.name and (p / MANIFEST).is_file()]
        for old in done[:-self.cfg.keep_last] if self.cfg.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def _all_gather(self, obj: Any) -> list[Any]:
        out = [None] * self.group_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


# a LoRA run's frozen base weights are read again from model.path; a checkpoint holds what trains
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def _trained_state(model, optim) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts, frozen tensors left out (torch keeps a frozen tied head's second
    name: a LoRA checkpoint of a tied model would hold the embedding again)."""
    model_sd, optim_sd = get_state_dict(model, optim, options=_TRAINED_ONLY)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def first_on_any_rank(message: str | None, group: dist.ProcessGroup | None) -> str | None:
    """The lowest rank's message that is not None, on every rank of `group` (collective); None if no rank had one."""
    messages = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, message, group=group)
    return next((m for m in messages if m is not None), None)


def _answer_request(request: str, saved: Path) -> None:
    """After the requested checkpoint: under SLURM, `scontrol requeue` ends this job and queues it again, and the
    new run resumes from `saved`; elsewhere (a request file touched by hand) the run goes on."""
    os.unlink(request)
    job = os.environ.get("SLURM_JOB_ID")
    print(f"checkpoint {saved} saved on request" + (f"; requeueing SLURM job {job}" if job else ""), flush=True)
    if job is not None:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"scontrol requeue {job} failed: {proc.stderr.strip()}; the job goes on", file=sys.stderr)


def verify_checkpoint(path: Path, share: int = 0, shares: int = 1) -> str | None:
    """Why `path` does not match its manifest ("__0_0.distcp truncated: 1234 of 5678 bytes"), or None if it
    does. Only every `shares`-th file from `share` on is read, so that ranks can split the work."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}" if path.is_dir() else "no such directory"
    except (OSError, ValueError, KeyError) as err:
        return f"{MANIFEST} unreadable ({err})"
    for name, expected in sorted(files.items())[share::shares]:
        if (problem := _file_problem(path / name, expected)) is not None:
            return f"{name} {problem}"
    return None


def _file_problem(file: Path, expected: dict) -> str | None:
    try:
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{'truncated' if size < expected['bytes'] else 'too long'}: {size} of {expected['bytes']} bytes"
        return "checksum mismatch" if _file_entry(file) != expected else None
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"unreadable ({err})"


def _file_entry(file: Path) -> dict:
    """The file's manifest entry. sha256 is OpenSSL's, on the CPU's SHA instructions: ~3x blake2b's speed."""
    digest, size = hashlib.sha256(), 0
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*[0-9]") if p.is_dir()) if root.is_dir() else []


class _Writer(FileSystemWriter):
    """DCP's file writer, keeping the OSError (disk full, file too large) this rank hit: torch.save's zip writer
    chains it under a RuntimeError ("unexpected pos"), and the copy of that which DCP raises has lost it."""
    os_error: OSError | None = None

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except BaseException as err:
            self.os_error = next((e for e in (err, err.__context__) if isinstance(e, OSError)), None)
            raise


def _check_started_from(checkpoint: Path, model_path: str) -> None:
    started = json.loads((checkpoint / "meta.json").read_text()).get("config", {}).get("model", {}).get("path")
    if started is not None and Path(started).resolve() != Path(model_path).resolve():
        raise ForgeError(f"config error: model.path '{model_path}' is not the model that the run in "
                         f"{checkpoint.parent.parent} started from ('{started}'), whose checkpoint {checkpoint.name} "
                         "this run would resume: give another --out_dir (or --ckpt.resume never to start over there)")


def export_path(out_dir: str, export_dir: str | None) -> Path:
    """Where a run's final HF directory goes: `export_dir`, else `<out_dir>/hf`."""
    return Path(export_dir) if export_dir else Path(out_dir) / "hf"


def finished_run(checkpoint: Path | None, total_steps: int, export_dir: Path) -> bool:
    """The checkpoint a run would resume from is its last step's and the weights were exported after it:
    running again has nothing to do. (An export appears whole, by rename, or not at all; one older than the
    checkpoint is of an earlier run in the same directory, and is done again.)"""
    if checkpoint is None or json.loads((checkpoint / "meta.json").read_text())["step"] != total_steps:
        return False
    return export_dir.is_dir() and export_dir.stat().st_mtime >= checkpoint.stat().st_mtime


def finished_message(script: str, out_dir: str, total_steps: int, export_dir: Path) -> str:
    return (f"{script}: {out_dir} finished its {total_steps} steps and exported the model to {export_dir}: nothing "
            "to do (raise --train.steps to train on, or give another --out_dir)")


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
