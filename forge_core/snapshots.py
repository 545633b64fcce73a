"""The frozen opponent's weights: a pool of past snapshots of the policy (fictitious self-play), one engine.

Every `game.frozen_refresh_every` steps the policy's weights go into the frozen engine and a copy of what was sent
joins the pool; the oldest leaves once it holds `game.pool_size`. Each rank keeps its own share of a snapshot (the
WeightSync's packed rows: 1/R of the model, in the trainer's precision), so writing one into the engine again is
the sync's collective over the policy ranks, and the ranks load the same snapshots in the same order. A row played
against `frozen` draws one (its G games, one GRPO group, face the same) from the step's seed and its row id; the
pool is in each rank's checkpoint state, so a resumed run draws and plays as the straight one did.
"""

import random

import torch
import torch.distributed as dist

from .sync import Snapshot, WeightSync

__all__ = ["SnapshotPool"]


class SnapshotPool:
    """`sync` writes into the frozen engine (None: never refreshed; the engine keeps the start model it was built
    from, a pool of one). `kept`: a checkpoint's `state_dict()`, whose newest snapshot the engine gets."""

    def __init__(self, sync: WeightSync | None, size: int, group: dist.ProcessGroup | None,
                 kept: list[dict] | None = None):
        self.sync, self.size, self.group = sync, size, group
        self.snapshots = [Snapshot(**s) for s in kept] if sync and kept else [sync and sync.snapshot()]
        self.loaded = len(self.snapshots) - 1
        if sync and kept:
            sync(self.snapshots[-1])

    def __len__(self) -> int:
        return len(self.snapshots)

    def add(self) -> None:
        """Collective: the policy's weights now, into the engine and the pool."""
        self.sync()
        self.snapshots = [*self.snapshots, self.sync.snapshot()][-self.size:]
        self.loaded = len(self.snapshots) - 1

    def draw(self, seed: int, row_id: int) -> int:
        return random.Random(f"{seed}:{row_id}").randrange(len(self.snapshots))

    def drawn_anywhere(self, drawn: list[int]) -> list[int]:
        """Collective: the snapshots any policy rank drew, oldest first."""
        used = torch.zeros(len(self.snapshots))
        used[drawn] = 1
        if self.group is not None:
            dist.all_reduce(used, group=self.group)
        return used.nonzero().flatten().tolist()

    def load(self, index: int) -> None:
        """Collective: snapshot `index` (negative: counted from the newest) into the engine, unless it is there."""
        index %= len(self.snapshots)
        if index != self.loaded:
            self.sync(self.snapshots[index])
            self.loaded = index

    def state_dict(self) -> list[dict]:
        return [vars(s) for s in self.snapshots] if self.sync else []
