"""SFT throughput on the tiny default job: our train_sft.py on 1 and 2 ranks vs a single-process
Hugging Face `transformers.Trainer` doing the same work, as a markdown table for the README.

    python bench/bench_sft.py                       # about 4 minutes on 2 CPU cores (Xeon model 207)
    python bench/bench_sft.py --steps 100 --repeats 3

Same work on every side: the model of `configs/sft/tiny.yaml` in fp32, the same examples in the same steps
(`forge_core.data` encodes, samples and pads them), the config's sequences per step and micro-batches,
our AdamW and warm-up + cosine schedule, clipping at max_grad_norm, no activation checkpointing. The Trainer
takes each step's sequences in order, micro-batch by micro-batch, as it comes; train_sft.py deals them over its
ranks and micro-batches by length (`forge_core.data.micro_batches`: less padding, the same gradient).
tokens/s counts every non-pad input token of a global batch over the wall time of its steps: per step for the
Trainer, per window of LOG_EVERY steps for ours (what train_sft.py logs: its loss is summed over ranks only on
the steps it logs); a contender's figure is the median over the timed steps or windows (the first
`warmup_steps` are not timed), best of `repeats` interleaved runs (the machine is shared). Peak memory is
ru_maxrss of rank 0 (CPU) or of the Trainer process.
The Trainer runs twice: as it comes, and with glibc's malloc told (by environment) to keep freed memory, as
forge_core.dist does for our scripts; the ratio column is against the first.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LOG_EVERY = 5
HF = "HF transformers.Trainer"
# What forge_core.dist does with mallopt, given to the Trainer through glibc's environment: the extra HF row
# shows how much of our lead is the allocator setting alone.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


@dataclass
class BenchConfig:
    """Benchmark train_sft.py against transformers.Trainer on the same SFT job."""
    steps: int = 60                     # optimizer steps per run; the LR schedule spans them
    warmup_steps: int = 5               # first steps of every run are not timed (lazy init, allocator)
    repeats: int = 2                    # runs per contender, interleaved; the best is reported
    ranks: tuple[int, ...] = (1, 2)     # our train_sft.py is run on each of these world sizes
    config: str = "configs/sft/tiny.yaml"
    hf_worker: bool = False             # internal: be the Trainer subprocess and print its result as JSON


@dataclass
class Result:
    contender: str
    ranks: int
    tokens_per_s: float                 # median over timed steps (windows)
    peak_gb: float                      # ru_maxrss of rank 0 / of the Trainer process
    final_loss: float                   # train loss of the last step: equal losses show equal work


# ---- our train_sft.py under torchrun ----

def run_ours(cfg: BenchConfig, nproc: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="bench_sft_") as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train_sft.py", "--config", cfg.config, "--out_dir", out_dir, "--train.steps", str(cfg.steps),
               "--ckpt.resume", "never", "--train.log_every", str(LOG_EVERY)]
        run_checked(cmd)
        rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r["train/tokens_per_s"] for r in rows if r["step"] - LOG_EVERY >= cfg.warmup_steps]
    return Result("ours: train_sft.py", nproc, statistics.median(timed), rows[-1]["mem/peak_gb_rank0"],
                  rows[-1]["train/loss"])


# ---- transformers.Trainer, in its own process so that ru_maxrss is its own ----

def run_hf(cfg: BenchConfig, keep_freed_memory: bool) -> Result:
    cmd = [sys.executable, __file__, "--hf_worker", "--steps", str(cfg.steps), "--warmup_steps",
           str(cfg.warmup_steps), "--config", cfg.config]
    result = Result(**json.loads(run_checked(cmd, KEEP_FREED_MEMORY if keep_freed_memory else {}).splitlines()[-1]))
    if keep_freed_memory:
        result.contender += ", glibc keeping freed memory as ours does"
    return result


def hf_worker(cfg: BenchConfig) -> None:
    """Build the exact per-step batches of train_sft.py and train them with transformers.Trainer."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    sys.path.insert(0, str(REPO))      # train_sft.py is a script at the repo root, not a package module
    from forge_core.config import load_config
    from forge_core.data import collate_sft, sample_indices
    from forge_core.model import load_tokenizer
    from forge_core.optim import build_optimizer
    from train_sft import SFTConfig, load_examples

    sft = load_config(SFTConfig, ["--config", cfg.config, "--train.steps", str(cfg.steps)])
    tokenizer = load_tokenizer(sft.model)
    examples, _, _ = load_examples(sft.data, tokenizer)
    batches = [[examples[i] for i in sample_indices(step, sft.train.batch_size, len(examples), sft.train.seed)]
               for step in range(cfg.steps)]
    dataset = [{"input_ids": ids, "labels": labels} for batch in batches for ids, labels in batch]  # step order
    tokens_per_step = [sum(len(ids) for ids, _ in batch) for batch in batches]

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        pairs = [(f["input_ids"], f["labels"]) for f in features]
        return collate_sft(pairs, tokenizer.pad_token_id, sft.data.pack, sft.data.max_length)

    class StepTimer(TrainerCallback):
        """Wall time from the end of one optimizer step to the end of the next: all the Trainer does per step."""
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.ends.append(time.perf_counter())

    torch.manual_seed(sft.train.seed)
    model = AutoModelForCausalLM.from_pretrained(sft.model.path, dtype=torch.float32)
    optim, sched = build_optimizer(model, sft.optim, cfg.steps)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_hf_"), max_steps=cfg.steps,
        per_device_train_batch_size=sft.train.micro_batch_size,
        gradient_accumulation_steps=sft.train.batch_size // sft.train.micro_batch_size,
        max_grad_norm=sft.optim.max_grad_norm, train_sampling_strategy="sequential", use_cpu=True, bf16=False,
        gradient_checkpointing=False, dataloader_num_workers=0, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True, seed=sft.train.seed)
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                      optimizers=(optim, sched), callbacks=[timer])
    trainer.train()
    step_seconds = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    assert len(step_seconds) == cfg.steps, f"Trainer ran {len(step_seconds)} steps, asked for {cfg.steps}"
    rates = [n / s for n, s in zip(tokens_per_step[cfg.warmup_steps:], step_seconds[cfg.warmup_steps:])]
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = Result(HF, 1, statistics.median(rates),
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, losses[-1])
    print(json.dumps(result.__dict__))


# ---- running and reporting ----

def run_checked(cmd: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=ENV | (env or {}), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench error: `{' '.join(cmd)}` exited {proc.returncode}\n{proc.stdout[-2000:]}\n"
                 f"{proc.stderr[-4000:]}")
    return proc.stdout


def format_table(results: list[Result]) -> str:
    hf = next(r for r in results if r.contender == HF)
    lines = ["| contender | ranks | tokens/s | peak memory / rank | final loss | vs HF |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.contender} | {r.ranks} | {r.tokens_per_s:,.0f} | {r.peak_gb:.2f} GB | "
                     f"{r.final_loss:.4f} | {r.tokens_per_s / hf.tokens_per_s:.2f}x |")
    return "\n".join(lines)


def ensure_tiny_model(cfg: BenchConfig) -> None:
    """The default config's model and data (artifacts/tiny) are built here, as `make run` builds them."""
    if cfg.config == BenchConfig.config and not (REPO / "artifacts/tiny/init/config.json").exists():
        print("building the tiny model and data: tools/build_tiny.py --out artifacts/tiny ...", flush=True)
        run_checked([sys.executable, "tools/build_tiny.py", "--out", "artifacts/tiny"])


def main() -> None:
    cfg = tyro.cli(BenchConfig, use_underscores=True)
    if cfg.hf_worker:
        return hf_worker(cfg)
    if cfg.warmup_steps >= cfg.steps:
        sys.exit(f"bench error: --warmup_steps {cfg.warmup_steps} leaves no timed steps of --steps {cfg.steps}")
    ensure_tiny_model(cfg)
    best: dict[tuple[str, int], Result] = {}
    for repeat in range(cfg.repeats):   # interleaved, so a burst of load on the shared machine hits every side
        for run in [*(lambda n=n: run_ours(cfg, n) for n in cfg.ranks), lambda: run_hf(cfg, False),
                    lambda: run_hf(cfg, True)]:
            r = run()
            print(f"run {repeat + 1}/{cfg.repeats}: {r.contender}, {r.ranks} rank(s): {r.tokens_per_s:,.0f} "
                  f"tokens/s, {r.peak_gb:.2f} GB, loss {r.final_loss:.4f}", flush=True)
            key = (r.contender, r.ranks)
            if key not in best or r.tokens_per_s > best[key].tokens_per_s:
                best[key] = r
    print(f"\nSFT, {cfg.config}, fp32, {cfg.steps} steps ({cfg.warmup_steps} untimed), "
          f"best of {cfg.repeats}; OMP_NUM_THREADS=1, {os.cpu_count()} CPU cores\n")
    print(format_table(list(best.values())))
    print("\nproduced by: " + " ".join(["python bench/bench_sft.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
