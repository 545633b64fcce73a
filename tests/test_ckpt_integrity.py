"""Checkpoints that prove themselves: a damaged checkpoint (truncated, deleted or flipped shard) is named in one
line and resume falls back past it; a write over the file-size limit ends the run with one line and leaves the
previous checkpoint loadable; so does a failed export, and running again exports; running a finished run again
does nothing. Unit tests in one process (a gloo world of 1), then the tiny SFT job on 2 ranks."""

import os
import re
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from conftest import (REPO, assert_clean_error, assert_same_curve, read_metrics, run_script, script_command,
                      script_env, tiny_sft_args)
from forge_core.ckpt import MANIFEST, CheckpointConfig, Checkpointer, finished_run, verify_checkpoint
from forge_core.config import ForgeError
from forge_core.weights import export_hf

SFT_STEPS = 4                    # a checkpoint after every one, all kept
ARGS = ["--train.steps", str(SFT_STEPS), "--train.batch_size", "8", "--train.micro_batch_size", "4",
        "--train.log_every", "1", "--train.eval_every", "0", "--data.eval_rows", "8", "--optim.warmup_steps", "2",
        "--ckpt.save_every", "1", "--ckpt.keep_last", str(SFT_STEPS)]
SFT_KEYS = ("train/loss", "train/lr", "train/grad_norm")
MODEL = "artifacts/tiny/init"            # the one-rank runs' model.path


# ---- damage, each returning what verification must say about the file ----

def truncate(file: Path) -> str:
    size = file.stat().st_size
    os.truncate(file, size // 2)
    return f"truncated: {size // 2} of {size} bytes"


def delete(file: Path) -> str:
    file.unlink()
    return "missing"


def flip_byte(file: Path) -> str:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01                 # tensor bytes: loading would succeed, with one wrong weight
    file.write_bytes(data)
    return "checksum mismatch"


DAMAGES = [truncate, delete, flip_byte]


# ---- one process (a gloo world of 1), a small model ----

@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def saved(out: Path, steps: list[int], keep_last: int = 2) -> tuple[Checkpointer, list[Path]]:
    model = nn.Linear(128, 128)                  # 64 KiB of weights, 192 KiB with Adam
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 128)).sum().backward()
    optim.step()
    ckpt = Checkpointer(out, CheckpointConfig(keep_last=keep_last))
    meta = {"scheduler": {}, "config": {"model": {"path": MODEL}}}
    return ckpt, [ckpt.save(step, model, optim, meta) for step in steps]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_is_used(one_rank, tmp_path, capsys, damage):
    ckpt, (first, second) = saved(tmp_path, [1, 2])
    assert verify_checkpoint(first) is None and verify_checkpoint(second) is None
    problem = f"__0_0.distcp {damage(second / '__0_0.distcp')}"
    assert verify_checkpoint(second) == problem
    assert ckpt.resume_path(MODEL) == first
    assert capsys.readouterr().err == f"checkpoint {second} is damaged ({problem}); trying the one before it\n"
    ckpt.cfg.resume = str(second)
    with pytest.raises(ForgeError, match=re.escape(f"checkpoint error: ckpt.resume '{second}': {problem}")):
        ckpt.resume_path(MODEL)


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(one_rank, tmp_path):
    ckpt, (first, second) = saved(tmp_path, [1, 2])
    (first / MANIFEST).unlink()
    delete(second / "meta.json")
    with pytest.raises(ForgeError, match="no intact checkpoint in .*step_000002: meta.json missing; "
                                         "step_000001: no manifest.json"):
        ckpt.resume_path(MODEL)


def test_a_run_of_another_model_in_out_dir_is_not_resumed(one_rank, tmp_path):
    """Found in out_dir, a checkpoint must come from the model the run names (the same path written another way
    is the same model); one named by `ckpt.resume` is the user's choice."""
    ckpt, [first] = saved(tmp_path, [1])
    assert ckpt.resume_path(f"./{MODEL}/") == first
    with pytest.raises(ForgeError, match=re.escape(f"config error: model.path 'runs/sft/hf' is not the model that "
                                                   f"the run in {tmp_path} started from ('{MODEL}'), whose checkpoint "
                                                   "step_000001 this run would resume: give another --out_dir")):
        ckpt.resume_path("runs/sft/hf")
    ckpt.cfg.resume = str(first)
    assert ckpt.resume_path("runs/sft/hf") == first


def test_pruning_keeps_the_newest_and_ignores_checkpoints_past_a_fall_back(one_rank, tmp_path):
    ckpt, paths = saved(tmp_path, [1, 2, 3, 5])
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_000003", "step_000005"]
    truncate(paths[-1] / "__0_0.distcp")
    _, [fourth] = saved(tmp_path, [4])           # the run that fell back to step 3 saves step 4
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_000003", "step_000004", "step_000005"]
    assert ckpt.resume_path(MODEL) == fourth


def test_a_write_over_the_file_size_limit_is_one_error_and_changes_nothing(one_rank, tmp_path):
    ckpt, [first] = saved(tmp_path, [1])
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))   # the shard is ~200 KiB
    try:
        with pytest.raises(ForgeError) as err:
            saved(tmp_path, [2])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value) == ("checkpoint error: writing step_000002 failed on rank 0: [Errno 27] File too large; "
                              "the previous checkpoint step_000001 is untouched")
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_000001"]
    assert verify_checkpoint(first) is None and ckpt.resume_path(MODEL) == first


def test_an_export_over_the_file_size_limit_is_one_error_and_keeps_the_earlier_export(one_rank, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))   # ~200 KiB of weights
    out = tmp_path / "hf"
    export_hf(model, None, out)
    exported = {f.name: f.read_bytes() for f in out.iterdir()}
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limits[1]))
    try:
        with pytest.raises(ForgeError) as err:
            export_hf(model, None, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value).startswith(f"export error: writing {out} failed: ") and "File too large" in str(err.value)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == exported and not (tmp_path / "hf.tmp").exists()


def test_a_run_is_finished_only_with_its_last_checkpoint_and_a_later_export(tmp_path):
    checkpoint, export = tmp_path / "checkpoints" / "step_000004", tmp_path / "hf"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text('{"step": 4}')
    assert not finished_run(None, 4, export) and not finished_run(checkpoint, 4, export)     # nothing exported
    export.mkdir()
    os.utime(checkpoint, (1e9, 1e9))
    assert finished_run(checkpoint, 4, export)
    assert not finished_run(checkpoint, 8, export)               # more steps asked for: train on
    os.utime(export, (1e9 - 1, 1e9 - 1))
    assert not finished_run(checkpoint, 4, export)               # an earlier run's export: export again


# ---- the tiny SFT job, 2 ranks ----

@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt_straight")
    run_script("train_sft.py", tiny_sft_args(tiny, out, *ARGS), nproc=2)
    return out


def checkpoints_of(straight: Path, out: Path, steps: range) -> Path:
    """`out` holding the straight run's checkpoints of `steps` and no metrics, so a resumed run logs its own."""
    for step in steps:
        shutil.copytree(straight / "checkpoints" / f"step_{step:06d}", out / "checkpoints" / f"step_{step:06d}")
    return out / "checkpoints"


def assert_resumed_curve(out: Path, straight: Path, first_step: int) -> None:
    run, reference = read_metrics(out), read_metrics(straight)
    assert sorted(run) == list(range(first_step, SFT_STEPS + 1))
    assert_same_curve(run, reference, range(first_step, SFT_STEPS + 1), SFT_KEYS)
    assert run[SFT_STEPS]["eval/loss"] == pytest.approx(reference[SFT_STEPS]["eval/loss"], rel=1e-6)


def test_sft_falls_back_past_damaged_checkpoints_and_reproduces_the_curve(tiny, straight, tmp_path):
    """Steps 4, 3 and 2 damaged three ways, in shards that rank 1 or rank 0 checksums: each is named in one
    line, the run resumes from step 1 and logs the straight run's numbers from step 2 on."""
    checkpoints = checkpoints_of(straight, tmp_path, range(1, SFT_STEPS + 1))
    damaged = {step: f"{shard} {damage(checkpoints / f'step_{step:06d}' / shard)}" for step, shard, damage in
               [(4, "__0_0.distcp", flip_byte), (3, "__1_0.distcp", delete), (2, "__0_0.distcp", truncate)]}
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS), nproc=2)
    reports = [f"checkpoint {checkpoints / f'step_{step:06d}'} is damaged ({problem}); trying the one before it"
               for step, problem in damaged.items()]
    assert [line for line in proc.stderr.splitlines() if "is damaged" in line] == reports
    assert f"resumed from {checkpoints / 'step_000001'}" in proc.stdout
    assert_resumed_curve(tmp_path, straight, 2)
    assert all(verify_checkpoint(checkpoints / f"step_{step:06d}") is None for step in (3, 4))


def test_sft_checkpoint_write_over_the_file_size_limit_fails_cleanly_and_the_run_resumes(tiny, straight, tmp_path):
    checkpoints = checkpoints_of(straight, tmp_path, range(1, 3))
    # 1 MiB: each rank's shard is ~7 MB; metrics.jsonl, TensorBoard, meta.json and the RNG files are a few KB
    limit = 1 << 20
    proc = subprocess.run(script_command("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS), nproc=2), cwd=REPO,
                          env=script_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert_clean_error(proc, "train_sft.py", "checkpoint error: writing step_000003 failed on rank 0: [Errno 27] "
                       "File too large; the previous checkpoint step_000002 is untouched")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]
    resumed = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS), nproc=2)
    assert f"resumed from {checkpoints / 'step_000002'}" in resumed.stdout
    assert_resumed_curve(tmp_path, straight, 3)


def test_sft_export_that_fails_is_one_line_and_running_again_exports(tiny, straight, tmp_path):
    """The finished run's last checkpoint, an export directory that cannot be made: one line on a clean exit;
    run again with a good one, it resumes at the last step and exports the straight run's weights; run a third
    time, it says so and stops before loading the model; with another model.path, it says that."""
    checkpoints = checkpoints_of(straight, tmp_path, range(SFT_STEPS, SFT_STEPS + 1))
    blocked = tmp_path / "a_file" / "hf"
    blocked.parent.write_text("")
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS, "--export_dir", str(blocked)), nproc=2,
                      check=False)
    assert_clean_error(proc, "train_sft.py", f"export error: writing {blocked} failed: [Errno 20] Not a directory")
    again = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS), nproc=2)
    assert f"resumed from {checkpoints / f'step_{SFT_STEPS:06d}'}" in again.stdout
    assert f"exported {tmp_path / 'hf'}" in again.stdout
    ours, straight_run = (load_file(d / "hf" / "model.safetensors") for d in (tmp_path, straight))
    assert ours.keys() == straight_run.keys() and all(torch.equal(ours[k], straight_run[k]) for k in ours)
    finished = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS), nproc=2)
    assert finished.stdout.strip() == (f"sft: {tmp_path} finished its {SFT_STEPS} steps and exported the model to "
                                       f"{tmp_path / 'hf'}: nothing to do (raise --train.steps to train on, or give "
                                       "another --out_dir)")
    other = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *ARGS, "--model.path", str(straight / "hf")),
                       nproc=2, check=False)
    assert_clean_error(other, "train_sft.py", f"config error: model.path '{straight / 'hf'}' is not the model that "
                       f"the run in {tmp_path} started from")
