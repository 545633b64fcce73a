"""Checkpoint writer for the kill -9 test: `write OUT` saves step 1, 2, 3, ... forever (every parameter
and optimizer state filled with the step number, so a loaded checkpoint proves its own consistency);
`check OUT` loads the latest complete checkpoint into a fresh model and prints {"step", "consistent"}."""

import json
import sys

import torch
from torch import nn

from forge_core.ckpt import CheckpointConfig, Checkpointer
from forge_core.dist import close_dist, init_dist


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])     # 32 MiB of weights, 96 with Adam
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 1024)).sum().backward()
    optim.step()                                                           # creates the Adam state
    return model, optim


def fill(model: nn.Module, optim: torch.optim.Optimizer, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            for t in optim.state[p].values():
                t.fill_(value)


def main(mode: str, out: str) -> None:
    init_dist()
    model, optim = build()
    ckpt = Checkpointer(out, CheckpointConfig(keep_last=2))
    if mode == "write":
        step = 0
        while True:
            step += 1
            fill(model, optim, step)
            ckpt.save(step, model, optim, {"value": step})
            print(f"saved {step}", flush=True)
    path = ckpt.resume_path("")      # its meta holds no config
    fill(model, optim, -1.0)
    meta = ckpt.load(path, model, optim)
    tensors = [*model.parameters(), *(t for s in optim.state.values() for t in s.values() if t.dim() > 0)]
    consistent = all(bool((t == meta["value"]).all()) for t in tensors)
    print(json.dumps({"step": meta["step"], "consistent": consistent}))
    close_dist()


if __name__ == "__main__":
    main(*sys.argv[1:3])
