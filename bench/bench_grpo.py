"""GRPO on the default job (configs/grpo/tiny.yaml, 3 ranks: policy | reference | reward): the step broken into
its phases, and each figure beside its peer measured in the same bench run, as markdown tables for the README.

    python bench/bench_grpo.py                       # about 5 minutes on 2 CPU cores (+1 min once: the TRL venv)
    python bench/bench_grpo.py --steps 30 --no_trl --model runs/sft-tiny/hf

One contender at a time, OMP_NUM_THREADS=1; figures are medians over the steps after --warmup_steps.
- ours: train_grpo.py; phases from OUT/metrics.jsonl (time/step is wall clock per step, logging included, as
  TRL's step timer sees it), peak RSS of every rank polled from /proc.
- generation peer: a plain-process vLLM engine (fp32, eager) on the same per-step chat prompts, one request
  of n=G samples each, same max_tokens, KV block size, max_num_seqs, T=1, logprobs=0, token ids only
  (detokenize=False), as ours.
- step peer: TRL GRPOTrainer with HF generate in its own venv (--trl_venv): fp32, no gradient checkpointing,
  loss dapo, beta 0, our lr, betas, clipping, G, completion length, and our prompts in our order.
- sync peers. The default layout's one policy rank loads its own engine: no bytes cross ranks, so its peer is
  a memcpy of the same bytes. Ours with 2 policy ranks (each rank sends its block of one flat buffer of FSDP
  shards to the other, then each engine copies the full weights in) is set against one flat gloo broadcast of the
  same bytes from rank 0 to rank 1 (a 2-process job, nothing else running), timed as the sync meets it in a
  step: each time after 4x the last-level cache of other data was read and the sender wrote the bytes, as a
  training pass and an optimizer step do (also printed: the same broadcast back to back, all in cache); the same job
  times one flat all-gather of those bytes (half from each rank), the collective our sends stand in for.
- held-out accuracy of the start model and both final models, greedy and of G samples per prompt at T=1: one
  vLLM evaluator, same rows and reward.
"""
import argparse
import json
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
PHASES = ("time/generate", "time/score", "time/train", "time/sync", "time/step", "perf/generate_tokens_per_s",
          "perf/train_tokens_per_s", "sync/seconds", "sync/gather_seconds", "sync/gigabytes", "mem/peak_gb_rank0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="GRPO steps for ours and TRL (accuracy is after these)")
    p.add_argument("--warmup_steps", type=int, default=5, help="first steps of each run are not timed")
    p.add_argument("--sync_steps", type=int, default=30, help="steps of the 2-policy-rank run (sync only)")
    p.add_argument("--model", default=None, help="start model (HF dir); default runs/sft-tiny/hf, built if missing")
    p.add_argument("--config", default="configs/grpo/tiny.yaml")
    p.add_argument("--no_trl", action="store_true", help="skip the TRL GRPOTrainer peer")
    p.add_argument("--trl_venv", default=str(REPO / ".trl-venv"), help="created once (git-ignored)")
    p.add_argument("--worker", choices=["vllm", "trl", "broadcast"], help="internal: run one peer, print JSON")
    p.add_argument("--spec", default=None, help="internal: the worker's JSON input file")
    return p.parse_args(argv)


# ---- running subprocesses; peak RSS of every rank of a torchrun job ----

def run_checked(cmd: list[str], env: dict | None = None, poll_ranks: bool = False) -> tuple[str, dict[int, float]]:
    """Run `cmd` in the repo; return its stdout and, with poll_ranks, peak RSS (GB) per RANK of its descendants."""
    peaks: dict[int, float] = {}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            if poll_ranks:
                _rank_peaks(proc.pid, peaks)
            time.sleep(0.25)
        log.seek(0)
        out = log.read()
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


def worker(kind: str, spec: dict, launcher: list[str] | None = None) -> dict:
    """Run this file as a worker (own process, or `launcher`: another venv's python, torchrun); its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        out, _ = run_checked([*(launcher or [sys.executable]), __file__, "--worker", kind, "--spec", f.name])
    return last_json(out)


def last_json(out: str) -> dict:
    """The worker's result: its last stdout line that is a JSON object (libraries may log after it)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


# ---- the contenders ----

def run_ours(args: argparse.Namespace, model: str, out_dir: str, steps: int, *extra: str) -> tuple[list[dict], dict]:
    nproc = 3
    cmd = torchrun(nproc, "train_grpo.py", "--config", args.config, "--model.path", model, "--out_dir", out_dir,
                   "--ckpt.resume", "never", "--ckpt.save_every", "0", "--train.steps", str(steps), *extra)
    _, peaks = run_checked(cmd, poll_ranks=True)
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows, peaks


def vllm_worker(spec: dict) -> dict:
    """Standalone engine: tokens/s over the batches (one request of n=G per prompt); held-out accuracy, greedy
    and of G samples per prompt at T=1."""
    import torch
    from vllm import LLM, SamplingParams
    sys.path.insert(0, str(REPO))
    from rewards import addition_correct
    llm = LLM(model=spec["model"], tokenizer=spec["tokenizer"], dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=2**28, seed=0, block_size=spec["block_size"],
              max_num_seqs=spec["max_num_seqs"])
    rates = []
    sample = SamplingParams(n=spec["G"], max_tokens=spec["max_tokens"], temperature=1.0, logprobs=0, detokenize=False)
    for batch in spec["batches"]:
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], sample, use_tqdm=False)
        rates.append(sum(len(c.token_ids) for o in outputs for c in o.outputs) / (time.perf_counter() - t0))
    def accuracy(params: SamplingParams) -> float:
        # the same draws whatever ran before; the engine samples with torch's RNG, as ours does (a per-request
        # seed fails on CPU once vLLM splits a prefill across steps: "CPU Generator does not use offset")
        torch.manual_seed(0)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["eval_prompts"]], params, use_tqdm=False)
        correct = [addition_correct(c.text, {"answer": a}) for o, a in zip(outputs, spec["eval_answers"])
                   for c in o.outputs]
        return sum(correct) / len(correct)
    return {"tokens_per_s": statistics.median(rates) if rates else None,
            "accuracy": accuracy(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)),
            "accuracy_sampled": accuracy(SamplingParams(n=spec["G"], max_tokens=spec["max_tokens"], temperature=1.0))}


def trl_worker(spec: dict) -> dict:
    """TRL GRPOTrainer on the same prompts in the same order (no shuffle: one step = the next B prompts x G)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    sys.path.insert(0, str(REPO))
    from rewards import addition_correct

    def addition_reward(completions: list, answer: list[str], **_) -> list[float]:
        return [addition_correct(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs) -> None:
            self.ends.append(time.perf_counter())

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in spec["rows"]])
    G = spec["G"]
    config = GRPOConfig(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["B"] * G,
        num_generations=G, max_completion_length=spec["max_tokens"], temperature=1.0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        weight_decay=0.0, max_grad_norm=spec["max_grad_norm"], beta=0.0, loss_type="dapo", epsilon=0.2,
        scale_rewards="group", shuffle_dataset=False, use_vllm=False, bf16=False, gradient_checkpointing=False,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(spec["model"]), callbacks=[timer])
    trainer.train()
    trainer.save_model(spec["out_dir"] + "/final")
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

    result = {"seconds": slowest_median(lambda: dist.broadcast(full, src=0, group=group), group,
                                        as_in_a_step(full if sender else full[:0])),
              "all_gather_seconds": slowest_median(lambda: dist.all_gather_single(full, half, group=group), group,
                                                   as_in_a_step(half)),
              "hot_seconds": slowest_median(lambda: dist.broadcast(full, src=0, group=group), group)}
    dist.destroy_process_group()
    return result if sender else None


def slowest_median(collective, group, before=lambda: None) -> float:
    import torch
    import torch.distributed as dist
    seconds = []
    for _ in range(30):
        before()
        dist.barrier(group)
        t0 = time.perf_counter()
        collective()
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor(seconds[5:], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(slowest.tolist())


def memcpy_seconds(nbytes: int) -> float:
    import torch
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(30):
        t0 = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[5:])


# ---- set-up, reporting ----

def ensure_venv(path: str) -> str:
    python = Path(path) / "bin" / "python"
    if not (Path(path) / ".installed").exists():
        print(f"installing TRL into {path} (once) ...", flush=True)
        run_checked([sys.executable, "-m", "venv", path])
        run_checked([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl==1.16.0"])
        (Path(path) / ".installed").touch()
    return str(python)


def ensure_model(args: argparse.Namespace) -> str:
    """--model, else runs/sft-tiny/hf as the README pipeline makes it (build the tiny task, then SFT on 2 ranks)."""
    if args.model:
        return args.model
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


def report(r: dict, args: argparse.Namespace) -> str:
    m, m2, n, nan = r["ours"], r["ours_2policy"], args.steps, float("nan")
    peaks = " / ".join(f"{r['peaks'].get(k, nan):.2f}" for k in range(3))
    lines = [f"GRPO, {args.config}, model {r['model']}, {r['B']} prompts x G={r['G']}, max_tokens {r['C']}, "
             f"{n} steps (medians of steps {args.warmup_steps + 1}-{n}); OMP_NUM_THREADS=1, {os.cpu_count()} CPU cores",
             "", "| ours, per step | median |", "|---|---:|",
             *(f"| {k}{PHASE_NOTES.get(k, '')} | {m[k]:.3f} s |"
               for k in STEP_PHASES),
             f"| metrics, logging (rest of each wall-clock step) | {m['rest']:.3f} s |",
             f"| time/step (wall clock) | {m['time/step']:.3f} s |",
             f"| generation | {m['perf/generate_tokens_per_s']:,.0f} tokens/s |",
             f"| training (completion tokens) | {m['perf/train_tokens_per_s']:,.0f} tokens/s |",
             f"| weight sync | {m['sync/seconds'] * 1e3:.1f} ms, {m['sync/gigabytes'] * 1e3:.2f} MB, "
             f"{m['sync/gigabytes'] / m['sync/seconds']:.2f} GB/s |",
             f"| peak RSS policy / reference / reward | {peaks} GB |", "",
             "| figure | ours | peer | peer is | ours / peer | target | met |", "|---|---:|---:|---|---:|---:|---|"]
    if r.get("trl"):
        lines.append(compare("step time", f"{m['time/step']:.3f} s", f"{r['trl']['step_s']:.3f} s",
                             "TRL 1.16 GRPOTrainer, HF generate", m["time/step"] / r["trl"]["step_s"], 1 / 3, True))
        lines.append(f"| step time, layout 2 policy + 1 reward rank ({args.sync_steps} steps) | {m2['time/step']:.3f} s "
                     f"| {r['trl']['step_s']:.3f} s | TRL as above: one process, so one of the 2 cores | "
                     f"{m2['time/step'] / r['trl']['step_s']:.2f} | | |")
    gen, peer_gen = m["perf/generate_tokens_per_s"], r["vllm"]["tokens_per_s"]
    lines.append(compare("generation", f"{gen:,.0f} tok/s", f"{peer_gen:,.0f} tok/s", "standalone vLLM engine",
                         gen / peer_gen, 0.9, False))
    mb = m2["sync/gigabytes"] * 1e3
    lines.append(f"| weight sync, 1 policy rank (default; no bytes cross ranks, so no broadcast to compare with) "
                 f"| {m['sync/seconds'] * 1e3:.2f} ms | {r['memcpy_s'] * 1e3:.2f} ms | memcpy of the same {mb:.2f} MB "
                 f"(in cache) | {m['sync/seconds'] / r['memcpy_s']:.2f} | | |")
    lines.append(compare(f"weight sync, 2 policy ranks (pack, exchange, own rows in: "
                         f"{m2['sync/gather_seconds'] * 1e3:.2f} ms)",
                         f"{m2['sync/seconds'] * 1e3:.2f} ms", f"{r['broadcast']['seconds'] * 1e3:.2f} ms",
                         f"one flat gloo broadcast of the same {mb:.2f} MB, rank 0 -> 1, caches as a step leaves "
                         f"them (back to back, all in cache: {r['broadcast']['hot_seconds'] * 1e3:.2f} ms; a flat "
                         f"all-gather of them: {r['broadcast']['all_gather_seconds'] * 1e3:.2f} ms)",
                         m2["sync/seconds"] / r["broadcast"]["seconds"], 2, True))
    if r.get("trl"):
        lines.append(f"| peak RSS | {max(r['peaks'].values()):.2f} GB (largest rank) | {r['trl']['peak_gb']:.2f} GB "
                     f"| TRL process | | | |")
    for kind, key in (("greedy", "accuracy"), ("sampled (T=1, G per prompt)", "accuracy_sampled")):
        ours, start, trl = r[key]["ours"], r[key]["start"], r[key].get("trl")
        figure = f"held-out {kind} accuracy after {n} steps ({start:.3f} at start)"
        if trl is None:
            lines.append(f"| {figure} | {ours:.3f} | | | | | |")
        else:
            lines.append(compare(figure, f"{ours:.3f}", f"{trl:.3f}", "TRL", ours / max(trl, 1e-9), 1.0, False))
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        result = {"vllm": vllm_worker, "trl": trl_worker, "broadcast": broadcast_worker}[args.worker](
            json.loads(Path(args.spec).read_text()))
        if result is not None:
            print(json.dumps(result))
        return
    if args.warmup_steps >= min(args.steps, args.sync_steps):
        sys.exit("bench error: --warmup_steps leaves no timed steps")
    sys.path.insert(0, str(REPO))
    from forge_core.config import load_config
    from forge_core.data import chat_prompt_ids, read_rows, sample_indices
    from forge_core.model import ModelConfig, load_tokenizer
    from train_grpo import GRPOConfig

    model = ensure_model(args)
    trl_python = None if args.no_trl else ensure_venv(args.trl_venv)
    cfg = load_config(GRPOConfig, ["--config", args.config, "--model.path", model, "--train.steps", str(args.steps)])
    B, G, C = cfg.train.prompts_per_step, cfg.sampling.num_generations, cfg.sampling.max_tokens
    tok = load_tokenizer(ModelConfig(path=model))
    rows = read_rows(cfg.data.path, cfg.data.split, cfg.data.subset)
    eval_rows = read_rows(cfg.data.eval_path, cfg.data.eval_split, cfg.data.subset)[:cfg.data.eval_rows]
    step_rows = [[rows[i] for i in sample_indices(s, B, len(rows), cfg.train.seed)] for s in range(args.steps)]
    evaluation = {"tokenizer": model, "max_tokens": C, "G": G, "batches": [], "block_size": cfg.engine.block_size,
                  "max_num_seqs": cfg.engine.max_num_seqs,
                  "eval_prompts": [chat_prompt_ids(tok, r[cfg.data.prompt_field]) for r in eval_rows],
                  "eval_answers": [str(r[cfg.data.answer_field]) for r in eval_rows]}
    r: dict = {"model": model, "B": B, "G": G, "C": C, "accuracy": {}, "accuracy_sampled": {}}
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        print(f"ours: train_grpo.py, {args.steps} steps ...", flush=True)
        rows_ours, r["peaks"] = run_ours(args, model, f"{tmp}/ours", args.steps)
        r["ours"] = medians(rows_ours, args.warmup_steps)
        print("standalone vLLM engine ...", flush=True)
        batches = [[chat_prompt_ids(tok, row[cfg.data.prompt_field]) for row in step] for step in step_rows]
        r["vllm"] = worker("vllm", evaluation | {"model": model, "batches": batches[args.warmup_steps:]})
        record_accuracy(r, "start", r["vllm"])
        record_accuracy(r, "ours", worker("vllm", evaluation | {"model": f"{tmp}/ours/hf"}))
        r["accuracy"]["ours_logged"] = rows_ours[-1].get("eval/accuracy")
        if trl_python:
            print(f"TRL GRPOTrainer, {args.steps} steps ...", flush=True)
            r["trl"] = worker("trl", {"model": model, "out_dir": f"{tmp}/trl", "steps": args.steps, "B": B, "G": G,
                                      "max_tokens": C, "lr": cfg.optim.lr, "betas": list(cfg.optim.betas),
                                      "max_grad_norm": cfg.optim.max_grad_norm, "warmup_steps": args.warmup_steps,
                                      "rows": [{"prompt": row[cfg.data.prompt_field],
                                                "answer": str(row[cfg.data.answer_field])}
                                               for step in step_rows for row in step]}, launcher=[trl_python])
            record_accuracy(r, "trl", worker("vllm", evaluation | {"model": r["trl"]["final"]}))
        print(f"ours with 2 policy ranks, {args.sync_steps} steps; flat broadcast; memcpy ...", flush=True)
        rows2, _ = run_ours(args, model, f"{tmp}/ours2", args.sync_steps, "--layout.policy", "2",
                            "--layout.reference", "0", "--layout.reward", "1")
        r["ours_2policy"] = medians(rows2, args.warmup_steps)
        nbytes = int(r["ours_2policy"]["sync/gigabytes"] * 1e9)
        r["broadcast"] = worker("broadcast", {"nbytes": nbytes}, launcher=torchrun(2))
        r["memcpy_s"] = memcpy_seconds(nbytes)
    print("\n" + report(r, args))
    print("\nraw numbers: " + json.dumps(r, default=str))
    print("\nproduced by: " + " ".join(["python bench/bench_grpo.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
