"""Host memory of loading a model onto 2 FSDP ranks, two ways: `forge_core.weights.build_model` (the meta device,
sharded, each rank reading only its own slices of the safetensors files) and a full load (every rank builds the
whole model in fp32 with `from_pretrained`, then shards it: what the scripts did before).

    python bench/bench_load.py                     # SmolLM2-135M and a random Qwen3-1.7B-shaped model; ~4 min
    python bench/bench_load.py --models smollm2

Each way runs in fresh processes (torchrun, 2 ranks, gloo); a rank reports its peak RSS (ru_maxrss, which counts
the safetensors pages it mapped: clean page cache the kernel can drop), its peak anonymous memory (RssAnon, sampled
every 5 ms: what is its own) and its RSS after imports, before any weight. The Qwen3-1.7B-shaped model
(random weights in bf16, as the hub's checkpoint is stored: 28 layers, hidden 2048, vocabulary 151,936, tied
embeddings) is built once into artifacts/bench/qwen3-1.7b-shape (3.4 GB). A rank's fp32 shard is a half of the
model's fp32 bytes.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

REPO = Path(__file__).resolve().parents[1]
QWEN3_SHAPE = REPO / "artifacts" / "bench" / "qwen3-1.7b-shape"
SMOLLM2 = REPO / "artifacts" / "smollm2-135m"


@dataclass
class LoadBench:
    models: list[Literal["smollm2", "qwen3-1.7b"]] = field(default_factory=lambda: ["smollm2", "qwen3-1.7b"])
    worker: Literal["", "sharded", "broadcast", "full"] = ""   # internal: one way on this torchrun rank
    path: str = ""
    out: str = ""


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class AnonymousPeak:
    """The largest RssAnon (memory of this process's own, not file pages it maps) seen every 5 ms while it runs."""

    def __enter__(self):
        self.peak, self.running = 0.0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssAnon:"))
            self.peak = max(self.peak, int(line.split()[1]) / 1024)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()


def worker(cfg: LoadBench) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from forge_core.model import FSDPConfig, ModelConfig, shard
    from forge_core.weights import build_model
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    before = _rss_mib()
    with AnonymousPeak() as anonymous:
        if cfg.worker == "sharded":
            model = build_model(ModelConfig(path=cfg.path), mesh, FSDPConfig())
        elif cfg.worker == "broadcast":
            model = broadcast_from_rank0(cfg.path, mesh)
        else:
            model = shard(AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32), mesh, FSDPConfig())
    local = sum(p.to_local().numel() * 4 for p in model.parameters()) / 2 ** 20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"before": before, "peak": peak, "anonymous": anonymous.peak, "shard": local})
    if dist.get_rank() == 0:
        Path(cfg.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def broadcast_from_rank0(path: str, mesh):
    """torchtune's way: the sharded meta model made real, rank 0 reads the whole file (mmap) and
    `set_model_state_dict(broadcast_from_rank0=True)` sends each rank its shards."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from forge_core.model import FSDPConfig, ModelConfig, shard
    from forge_core.weights import _empty_model, _fill_buffers
    model = shard(_empty_model(ModelConfig(path=path)), mesh, FSDPConfig())
    model.to_empty(device="cpu")
    model.tie_weights()
    _fill_buffers(model)
    full = {k: v.float() for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()} \
        if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=False))
    return model


def build_qwen3_shape() -> None:
    """Qwen3-1.7B's config (hub: Qwen/Qwen3-1.7B) with random bf16 weights, written once."""
    if (QWEN3_SHAPE / "model.safetensors.index.json").is_file() or (QWEN3_SHAPE / "model.safetensors").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    config = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
    print("building a random Qwen3-1.7B-shaped model (bf16) ...", flush=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(QWEN3_SHAPE)


def run_way(way: str, path: Path) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        __file__, "--worker", way, "--path", str(path), "--out", out.name], check=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main(cfg: LoadBench) -> None:
    paths = {"smollm2": SMOLLM2, "qwen3-1.7b": QWEN3_SHAPE}
    if "smollm2" in cfg.models and not (SMOLLM2 / "config.json").is_file():
        subprocess.run([sys.executable, "tools/convert_smollm2.py", "--out", str(SMOLLM2)], check=True, cwd=REPO)
    if "qwen3-1.7b" in cfg.models:
        build_qwen3_shape()
    lines = []
    for name in cfg.models:
        runs = {way: run_way(way, paths[name]) for way in ("sharded", "broadcast", "full")}
        peak = {way: max(r["peak"] for r in ranks) for way, ranks in runs.items()}
        anonymous = {way: max(r["anonymous"] for r in ranks) for way, ranks in runs.items()}
        start = max(r["before"] for r in runs["sharded"])
        shard = runs["sharded"][0]["shard"]
        print(f"{name}: rank 0's fp32 shard {shard:.0f} MiB, a rank at start {start:.0f} MiB; peak anonymous memory "
              f"(RssAnon, without the mapped file's pages) sharded {anonymous['sharded']:.0f} MiB, broadcast from rank 0 "
              f"{anonymous['broadcast']:.0f} MiB (peak RSS {peak['broadcast']:.0f}), full {anonymous['full']:.0f} MiB",
              flush=True)
        lines.append(f"{name}: peak RSS per rank: sharded {peak['sharded']:.0f} MiB, full {peak['full']:.0f} MiB")
    print("\n".join(lines))


if __name__ == "__main__":
    args = tyro.cli(LoadBench)
    if args.worker:
        from forge_core.dist import run_main
        run_main(lambda: worker(args))
    else:
        main(args)
