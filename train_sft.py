"""Supervised fine-tuning with FSDP2: chat-formatted prompt/response pairs, loss on the response only.

    torchrun --standalone --nproc_per_node 2 train_sft.py --config configs/sft/tiny.yaml --optim.lr 3e-4
    sbatch slurm/sft.sh configs/sft/tiny.yaml

Every rank holds a shard of the model (fully_shard per decoder layer) and takes its slice of each global batch.
A run resumes from its latest checkpoint on restart; the final weights are exported as an HF directory.
"""

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    gc.disable()        # while the imports build what lives as long as the process (dist.freeze_startup_objects)

import torch
from pydantic import NonNegativeInt, PositiveInt

from forge_core.ckpt import CheckpointConfig, Checkpointer, export_path, finished_message, finished_run
from forge_core.config import ForgeError, config_to_dict, load_config
from forge_core.data import (IGNORE, DataConfig, chat_prompt_ids, collate_sft, encode_sft, fitting_prompts,
                             label_assistant_turns, micro_batches, read_rows, require_fields, require_text, sample_indices)
from forge_core.dist import Dist, DistConfig, close_dist, freeze_startup_objects, init_dist, run_main, set_phase
from forge_core.logprobs import chosen_logprobs
from forge_core.metrics import MetricLogger, peak_memory_gb, reduce_metrics
from forge_core.model import (FSDPConfig, ModelConfig, bf16_chosen, linear_kernel, load_tokenizer, set_gradient_sync,
                              turn_end)
from forge_core.moe import Routers, check_routers, real_tokens
from forge_core.optim import BadSteps, OptimConfig, build_optimizer, optimizer_step
from forge_core.tensor_parallel import vocab_parallel
from forge_core.weights import build_model, export_hf


@dataclass
class TrainConfig:
    steps: PositiveInt = 600
    batch_size: PositiveInt = 64        # sequences per optimizer step, over all ranks
    micro_batch_size: PositiveInt = 32  # sequences per forward on one rank (more if short); accumulation does the rest
    seed: int = 0
    log_every: PositiveInt = 10
    eval_every: NonNegativeInt = 200    # held-out loss + greedy exact match; 0 = only at the end
    eval_max_new_tokens: PositiveInt = 16
    stop_at_step: int | None = None     # end this run early, as a preemption would; the schedule still spans `steps`
    max_bad_steps: PositiveInt = 5      # steps in a row whose update is skipped (non-finite loss) before the run stops


@dataclass
class SFTConfig:
    """Supervised fine-tuning (forge-spmd)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="artifacts/tiny/init"))
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    out_dir: str = "runs/sft-tiny"
    export_dir: str | None = None       # final HF safetensors directory; None = <out_dir>/hf


# ---- data ----

Example = tuple[list[int], list[int]]


@dataclass
class Cuts:
    """What `load_examples` cut to fit data.max_length, for the log."""
    truncated: int              # training examples longer than data.max_length, cut to it
    skipped: int                # rows of data.path whose prompt alone fills it: no response token to train on
    warnings: list[str]         # a line for each file with rows skipped (held-out rows too)


def load_examples(cfg: DataConfig, tokenizer) -> tuple[list[Example], list[dict], Cuts]:
    """Tokenized training examples, held-out rows, and what was cut: a row whose prompt alone fills
    data.max_length is left out, a longer example is truncated."""
    rows = checked_rows(cfg, cfg.path, cfg.split)
    eval_rows = None if cfg.eval_path is None else checked_rows(cfg, cfg.eval_path, cfg.eval_split)[:cfg.eval_rows]
    limit, why = cfg.max_length - 1, f"data.max_length={cfg.max_length} leaves no response token to train on"
    warnings: list[str] = []
    train, prompt_ids = fitting_prompts(rows, tokenizer, cfg.prompt_field, limit, cfg.path, why, warnings.append)
    skipped = len(rows) - len(train)
    if eval_rows is not None:
        eval_rows, _ = fitting_prompts(eval_rows, tokenizer, cfg.prompt_field, limit, cfg.eval_path, why,
                                       warnings.append)
    elif cfg.eval_rows >= len(train):
        raise ForgeError(f"config error: data.eval_rows={cfg.eval_rows} leaves no training rows in {cfg.path}")
    else:
        n = len(train) - cfg.eval_rows
        train, prompt_ids, eval_rows = train[:n], prompt_ids[:n], train[n:]
    end_id = turn_end(tokenizer).ids[0]
    encoded = [encode_row(tokenizer, r, ids, cfg, end_id, (rows, cfg.path)) for ids, r in zip(prompt_ids, train)]
    held_out = (eval_rows, cfg.eval_path) if cfg.eval_path else (rows, cfg.path)
    for row in eval_rows if cfg.every_assistant_turn else []:       # checked now, not at the first evaluation
        encode_row(tokenizer, row, None, cfg, end_id, held_out)
    cuts = Cuts(sum(t for *_, t in encoded), skipped, warnings)
    return [(ids, labels) for ids, labels, _ in encoded], eval_rows, cuts


def encode_row(tokenizer, row: dict, prompt_ids: list[int] | None, cfg: DataConfig, end_id: int,
               source: tuple[list[dict], str] | None = None) -> tuple[list[int], list[int], bool]:
    """`encode_sft` of a row; with data.every_assistant_turn its prompt's assistant turns are trained too (a row
    whose template moves them is a data error naming the row of `source`: the file's rows and its name)."""
    prompt = row[cfg.prompt_field]
    ids, labels, truncated = encode_sft(tokenizer, prompt_ids or chat_prompt_ids(tokenizer, prompt),
                                        row[cfg.response_field], cfg.max_length, end_id)
    if cfg.every_assistant_turn and (wrong := label_assistant_turns(tokenizer, prompt, ids, labels, end_id)):
        rows, name = source or ([row], "a held-out row")
        raise ForgeError(f"data error: {name} row {next(i for i, r in enumerate(rows) if r is row) + 1}: "
                         f"{cfg.prompt_field}'s {wrong} (data.every_assistant_turn)")
    return ids, labels, truncated


def checked_rows(cfg: DataConfig, source: str, split: str) -> list[dict]:
    """A data file's rows, each with a prompt (a string or chat messages) and a response (a string)."""
    rows = read_rows(source, split, cfg.subset)
    require_fields(rows, [cfg.prompt_field, cfg.response_field], source)
    require_text(rows, cfg.prompt_field, source, messages=True)
    require_text(rows, cfg.response_field, source)
    return rows


def accumulation_steps(cfg: TrainConfig, world_size: int) -> int:
    per_step = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_step:
        raise ForgeError(f"config error: train.batch_size={cfg.batch_size} must be a multiple of "
                         f"train.micro_batch_size={cfg.micro_batch_size} x {world_size} ranks")
    return cfg.batch_size // per_step


# ---- the loss ----

def token_nll(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token NLL over the labelled (response) tokens of a micro-batch. The LM head runs only on
    the columns where some row has a label (HF's `logits_to_keep`): prompt positions need no logits."""
    targets = batch.pop("labels")[:, 1:]                                  # [N, S-1] next-token labels
    columns = (targets != IGNORE).any(0).nonzero().flatten()             # [K] positions that are trained on
    with vocab_parallel():                  # a tensor-parallel head's logits stay split over the vocabulary
        logits = model(**batch, use_cache=False, logits_to_keep=columns).logits        # [N, K, V]
    kept = targets[:, columns].flatten()
    labelled = (kept != IGNORE).nonzero().flatten()
    return -chosen_logprobs(logits.flatten(0, 1), labelled, kept[labelled])[0].sum()


def count_targets(examples: list[Example]) -> int:
    """Response tokens the loss is taken over: every label but the first (a prompt token, which nothing
    predicts), as `collate_sft` lays them out, packed or not."""
    return sum(sum(label != IGNORE for label in labels[1:]) for _, labels in examples)


def train_step(model, mine: list[list[Example]], global_targets: int, cfg: SFTConfig, d: Dist, pad_id: int,
               routers: Routers) -> float:
    """Forward/backward over this rank's micro-batches (`mine`); the loss is normalised by the *global* number of
    response tokens so that N ranks compute exactly what one process would (FSDP averages over ranks); an MoE's
    load-balancing loss, each micro-batch's, by their number.
    Returns this rank's summed NLL. Every rank counts the global batch's targets itself, so the gradient
    all-reduce is the step's only point where the ranks wait for each other."""
    loss_sum = 0.0
    for i, examples in enumerate(mine):
        set_gradient_sync(model, i == len(mine) - 1)
        mb = {k: v.to(d.device) for k, v in collate_sft(examples, pad_id, cfg.data.pack, cfg.data.max_length,
                                                         with_real=True).items()}
        with real_tokens(mb.pop("real_tokens")):          # what an MoE's routers count (forge_core/moe.py)
            nll = token_nll(model, mb)
        (nll * d.data_ranks / global_targets + routers.loss() / len(mine)).backward()
        loss_sum += nll.item()
    return loss_sum


# ---- held-out evaluation ----

@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], cfg: SFTConfig, d: Dist) -> dict[str, float]:
    """Held-out loss and greedy exact match; every rank takes its share of rows."""
    model.eval()
    mine = rows[d.data_rank::d.data_ranks]
    prompts, responses = [r[cfg.data.prompt_field] for r in mine], [r[cfg.data.response_field] for r in mine]
    nll, targets = 0.0, 0
    size, end_id = cfg.train.micro_batch_size, turn_end(tokenizer).ids[0]
    for i in range(0, len(mine), size):
        examples = [encode_row(tokenizer, r, None, cfg.data, end_id)[:2] for r in mine[i:i + size]]
        batch = collate_sft(examples, tokenizer.pad_token_id, pack=False, max_length=cfg.data.max_length)
        targets += int((batch["labels"][:, 1:] != IGNORE).sum())
        nll += token_nll(model, {k: v.to(d.device) for k, v in batch.items()}).item()
    answers = greedy_generate(model, tokenizer, prompts, cfg.train.eval_max_new_tokens, d)
    correct = sum(a.strip() == r.strip() for a, r in zip(answers, responses))
    sums = reduce_metrics({"nll": nll, "targets": targets, "correct": correct, "rows": len(mine)}, d.data_group)
    model.train()
    return {"eval/loss": sums["nll"] / sums["targets"], "eval/exact_match": sums["correct"] / sums["rows"]}


def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, d: Dist) -> list[str]:
    """HF generate; synced_gpus keeps every FSDP rank stepping until all are done (no all-gather deadlock)."""
    encoded = [chat_prompt_ids(tokenizer, p) for p in prompts] or [[tokenizer.pad_token_id]]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in encoded])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    out = model.generate(input_ids=input_ids.to(d.device), attention_mask=attention_mask.to(d.device),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=list(turn_end(tokenizer).ids), synced_gpus=d.world_size > 1)
    return tokenizer.batch_decode(out[:len(prompts), width:], skip_special_tokens=True)


# ---- main ----

def main() -> None:
    cfg = load_config(SFTConfig)
    d = init_dist(cfg.dist, cfg.fsdp.tensor_parallel_size)
    accum = accumulation_steps(cfg.train, d.data_ranks)
    ckpt = Checkpointer(cfg.out_dir, cfg.ckpt)
    path, export_dir = ckpt.resume_path(cfg.model.path), export_path(cfg.out_dir, cfg.export_dir)
    if finished_run(path, cfg.train.steps, export_dir):
        if d.is_rank0:
            print(finished_message("sft", cfg.out_dir, cfg.train.steps, export_dir))
        close_dist()
        return
    tokenizer = load_tokenizer(cfg.model)
    check_routers(cfg.model)
    examples, eval_rows, cuts = load_examples(cfg.data, tokenizer)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, d.mesh, cfg.fsdp, cfg.train.seed)
    optim, sched = build_optimizer(model, cfg.optim, cfg.train.steps)
    routers = Routers(model, cfg.model.router_aux_loss)
    start_step = 0
    if path is not None:
        meta = ckpt.load(path, model, optim, cfg.train.steps)
        sched.load_state_dict(meta["scheduler"])
        start_step = meta["step"]
    log = MetricLogger(cfg.out_dir, cfg.train.steps, enabled=d.is_rank0, start_step=start_step)
    bad_steps = BadSteps(cfg.train.max_bad_steps, log.print)
    for warning in cuts.warnings:
        log.print(warning)
    tp = cfg.fsdp.tensor_parallel_size
    tp_note = f" (of {tp} tensor-parallel ranks each)" if tp > 1 else ""
    log.print(f"sft: {len(examples)} examples ({cuts.truncated} truncated, {cuts.skipped} skipped), "
              f"{len(eval_rows)} held out; "
              f"{d.data_ranks} ranks{tp_note} x {cfg.train.micro_batch_size} x {accum} accumulation = "
              f"{cfg.train.batch_size} sequences/step; "
              + (f"CPU GEMMs: {linear_kernel(cfg.fsdp)}; " if d.mesh.device_type == "cpu" else "")
              + ("bf16; " if bf16_chosen(cfg.fsdp.mixed_precision, d.mesh.device_type == "cuda") else "fp32; ")
              + (f"resumed from {path}" if start_step else "fresh start"))

    freeze_startup_objects()        # the model, its optimizer and the examples among them
    end_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
    window_start, window_tokens = time.perf_counter(), 0        # tokens/s: wall clock since the last log
    for step in range(start_step, end_step):
        set_phase("train")
        batch = [examples[i] for i in sample_indices(step, cfg.train.batch_size, len(examples), cfg.train.seed)]
        targets = count_targets(batch)
        mine = micro_batches([len(ids) for ids, _ in batch], d.data_ranks, accum, cfg.data.pack)[d.data_rank]
        loss_sum = train_step(model, [[batch[i] for i in mb] for mb in mine], targets, cfg, d, tokenizer.pad_token_id,
                              routers)
        lr = sched.get_last_lr()[0]
        grad_norm = optimizer_step(model, optim, sched, cfg.optim.max_grad_norm)   # skips a non-finite update
        window_tokens += sum(len(ids) for ids, _ in batch)
        done = step + 1
        bad_steps.count(done, grad_norm)
        evaluating = done == end_step or (cfg.train.eval_every and done % cfg.train.eval_every == 0)
        if done % cfg.train.log_every == 0 or done == end_step or evaluating:
            metrics = {"train/loss": reduce_metrics({"loss": loss_sum}, d.data_group)["loss"] / targets,
                       "train/lr": lr, "train/grad_norm": grad_norm,
                       "train/tokens_per_s": window_tokens / (time.perf_counter() - window_start),
                       "train/skipped_steps": bad_steps.total, "mem/peak_gb_rank0": peak_memory_gb(d.device),
                       **routers.metrics()}
            if evaluating:
                set_phase("eval")
                metrics |= evaluate(model, tokenizer, eval_rows, cfg, d)
            log.log(done, metrics, ("train/loss", "train/lr", "train/tokens_per_s", "eval/loss", "eval/exact_match"))
            window_start, window_tokens = time.perf_counter(), 0
        meta = {"scheduler": sched.state_dict(), "samples_seen": done * cfg.train.batch_size,
                "config": config_to_dict(cfg)}
        set_phase("checkpoint")
        ckpt.maybe_save(done, end_step, model, optim, meta)
        if cfg.ckpt.export_every and done % cfg.ckpt.export_every == 0:
            export_hf(model, tokenizer, Path(cfg.out_dir) / f"hf_step_{done:06d}", adapter=cfg.model.lora.save_adapter)
    set_phase("export")
    if end_step == cfg.train.steps:
        export_hf(model, tokenizer, export_dir, adapter=cfg.model.lora.save_adapter)
        log.print(f"exported {export_dir}")
    log.close()
    close_dist()


if __name__ == "__main__":
    run_main(main)
