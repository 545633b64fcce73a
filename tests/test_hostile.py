"""A rank that stops answering ends the job within `dist.timeout_s`, named; an update with a non-finite loss
is skipped and counted, and too many in a row stop the run; hostile inputs are one line, printed once,
before any expensive work."""

import json
import math
import os
import re
import shutil
import signal
import time

import pytest
import torch

from conftest import (REPO, assert_clean_error, grpo_args, read_metrics, run_script, script_command, start,
                      tiny_sft_args)
from forge_core.config import ForgeError, load_config
from forge_core.data import sample_indices
from forge_core.model import ModelConfig, load_tokenizer
from forge_core.optim import BadSteps, OptimConfig, build_optimizer, optimizer_step
from test_fault_tolerance import wait_for, workers
from train_grpo import GRPOConfig, check_config
from train_sft import SFTConfig

TINY_GRPO = ["--config", str(REPO / "configs" / "grpo" / "tiny.yaml")]


# ---- a rank that stops answering ----

def test_a_frozen_rank_ends_the_job_within_the_timeout(tiny, tmp_path):
    """The reward rank is frozen (SIGSTOP) once step 1 is logged. The policy rank's next exchange times out
    after dist.timeout_s; it prints one line naming its phase and the frozen rank, and torchrun ends the job."""
    timeout_s = 20
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    args = grpo_args(tiny, out, "--train.steps", "50", "--dist.timeout_s", str(timeout_s))
    proc = start(script_command("train_grpo.py", args, 3), log)
    frozen = None
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text(), proc, "step 1",
                 timeout=600)
        frozen = workers(proc.pid)[2]
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        # A hung rank takes torchrun's SIGTERM at once; a stopped one only once continued (else torchrun waits
        # 30 s before its SIGKILL): continued right after that signal, it dies as a hung one would.
        wait_for(lambda: f"Sending process {frozen} closing signal SIGTERM" in log.read_text(), proc,
                 "torchrun ending the frozen rank", timeout=timeout_s + 60)
        os.kill(frozen, signal.SIGCONT)
        code = proc.wait(timeout=60)
        took = time.monotonic() - frozen_at
    finally:
        _kill_session(proc.pid, frozen)
    text = log.read_text()
    assert code != 0 and took < timeout_s + 60, (code, took, text[-3000:])
    lines = [line for line in text.splitlines() if "collective failed" in line]
    assert len(lines) == 1, text[-3000:]
    assert re.search(r"^\[rank 0 policy\] collective failed in phase exchange after \d+ s: .*; rank 2 reward in \w+ "
                     r"for \d+ s", lines[0]), lines[0]
    assert f'File "{REPO / "train_grpo.py"}"' not in text


def _kill_session(session: int, frozen: int | None) -> None:
    """What torchrun leaves behind (the frozen rank, its reward workers) goes, continued first."""
    for pid, sig in ((frozen, signal.SIGCONT), (session, signal.SIGKILL)):
        try:
            if pid is not None:
                (os.killpg if sig == signal.SIGKILL else os.kill)(pid, sig)
        except ProcessLookupError:
            pass


# ---- numbers that go bad ----

def test_an_update_with_nonfinite_gradients_is_skipped():
    model = torch.nn.Linear(4, 2)
    optim, sched = build_optimizer(model, OptimConfig(lr=0.1), total_steps=10)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(1, 4)).sum() * float("nan")).backward()
    assert math.isnan(optimizer_step(model, optim, sched, max_grad_norm=1.0))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters())), "the weights must not move"
    assert not optim.state and sched.last_epoch == 1, "Adam has not stepped; the schedule has"
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    assert math.isfinite(optimizer_step(model, optim, sched, max_grad_norm=1.0))
    assert not torch.equal(before[0], model.weight)


def test_an_update_that_overflows_the_weights_ends_the_run():
    model = torch.nn.Linear(4, 2)
    optim, sched = build_optimizer(model, OptimConfig(lr=3e38), total_steps=10)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(ForgeError, match=r"^training error: an update at lr 3e\+38 took the weights out of float range"):
        optimizer_step(model, optim, sched, max_grad_norm=1.0)


def test_bad_steps_in_a_row_end_the_run():
    printed = []
    bad = BadSteps(limit=2, warn=printed.append)
    for step, grad_norm in ((1, float("nan")), (2, 0.5), (3, float("inf"))):
        bad.count(step, grad_norm)
    assert (bad.total, bad.in_a_row) == (2, 1)
    assert printed == ["step 1: update skipped, gradient norm nan (1 in a row)",
                       "step 3: update skipped, gradient norm inf (1 in a row)"]
    with pytest.raises(ForgeError, match=r"^training error: 2 steps in a row, up to step 4, had a non-finite loss "
                                         r"or gradient norm \(train.max_bad_steps=2\)"):
        bad.count(4, float("nan"))


def test_grpo_skips_and_counts_nonfinite_updates(tiny, tmp_path):
    """One prompt's rewards overflow its group's advantages (a NaN loss) at steps 2, 4 and 5: step 2's update
    is skipped and counted and the run goes on; steps 4 and 5 in a row reach train.max_bad_steps=2."""
    rows = [json.loads(line) for line in (tiny / "data" / "train.jsonl").read_text().splitlines()]
    for step in (1, 3, 4):          # 0-based, 8 prompts a step (grpo_args), seed 0
        rows[sample_indices(step, 8, len(rows), 0)[0]]["overflow"] = True
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    proc = run_script("train_grpo.py", grpo_args(tiny, out, "--train.steps", "8", "--data.path", str(data),
                                                 "--rewards.functions", "tests/rewards_for_tests.py:overflows_on_marked_rows",
                                                 "--train.max_bad_steps", "2", "--layout.reference", "0"),
                      nproc=2, check=False)
    assert_clean_error(proc, "train_grpo.py", "training error: 2 steps in a row, up to step 5, had a non-finite loss")
    assert proc.stderr.count("training error") == 1 and "collective failed" not in proc.stderr, proc.stderr[-3000:]
    assert "step 2: update skipped" in proc.stdout
    metrics = read_metrics(out)
    assert [metrics[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 2]
    assert [math.isfinite(metrics[s]["train/grad_norm"]) for s in (1, 2, 3, 4)] == [True, False, True, False]
    assert 5 not in metrics


def test_sft_stops_before_overflowed_weights_are_saved(tiny, tmp_path):
    """A learning rate that overflows the weights ends the run at the first update, on both ranks, in one
    line; no checkpoint or export holds those weights."""
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, "--train.steps", "4", "--train.batch_size", "8",
                                                    "--train.micro_batch_size", "4", "--optim.lr", "1e30",
                                                    "--ckpt.save_every", "1"), nproc=2, check=False)
    assert_clean_error(proc, "train_sft.py", "training error: an update at lr", "took the weights out of float range")
    assert proc.stderr.count("training error") == 1, proc.stderr[-3000:]
    assert not list((tmp_path / "checkpoints").glob("step_*")) and not (tmp_path / "hf").exists()


# ---- hostile inputs: one line, before any work ----

@pytest.mark.parametrize("flags, message", [
    (["--optim.lr", "-1"], "'optim.lr' must be greater than 0, got -1.0"),
    (["--sampling.max_tokens", "0"], "'sampling.max_tokens' must be greater than 0, got 0"),
    (["--sampling.top_p", "1.5"], "'sampling.top_p' must be less than or equal to 1, got 1.5"),
    (["--optim.betas", "0.9", "1.0"], "'optim.betas' must be less than 1, got 1.0"),
    (["--train.max_bad_steps", "0"], "'train.max_bad_steps' must be greater than 0, got 0"),
    (["--dist.timeout_s", "-5"], "'dist.timeout_s' must be greater than 0, got -5.0"),
    (["--engine.kv_cache_gb", "0"], "'engine.kv_cache_gb' must be greater than 0, got 0.0"),
])
def test_numbers_out_of_range_are_named(flags, message):
    with pytest.raises(ForgeError) as err:
        load_config(GRPOConfig, [*TINY_GRPO, *flags])
    assert str(err.value) == f"config error: {message}"


def test_numbers_out_of_range_in_a_yaml_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  batch_size: 0\n")
    with pytest.raises(ForgeError) as err:
        load_config(SFTConfig, ["--config", str(bad)])
    assert str(err.value) == f"config error: {bad}: 'train.batch_size' must be greater than 0, got 0"


def test_a_kv_cache_larger_than_the_machine_is_named():
    cfg = load_config(GRPOConfig, [*TINY_GRPO, "--engine.kv_cache_gb", "1000000"])
    with pytest.raises(ForgeError, match=r"^config error: engine.kv_cache_gb=1e\+06 x 1 engine\(s\) per node is "
                                         r"more than this machine's \d+ GB of memory$"):
        check_config(cfg, 3, 3)


@pytest.mark.parametrize("section, field, value, message", [
    ("rewards", "functions", [], "rewards.functions is empty and there is no env.name: nothing gives rewards"),
    ("rewards", "accuracy", "nope", "rewards.accuracy 'nope' is none of rewards.functions ['addition_correct']"),
    ("sampling", "temperature", 0.0, "sampling.temperature must be > 0 for GRPO (the logprobs are of T-scaled logits)"),
    *[("sampling", knob, value, "sampling.top_p < 1 and sampling.top_k are not for GRPO: the engine's logprobs would "
       "be of the truncated distribution, the trainer's of the full one (a biased IS weight)")
      for knob, value in (("top_p", 0.9), ("top_k", 20))],
])
def test_what_grpo_cannot_train_with_is_named(section, field, value, message):
    cfg = load_config(GRPOConfig, TINY_GRPO)
    setattr(getattr(cfg, section), field, value)
    with pytest.raises(ForgeError) as err:
        check_config(cfg, 3, 3)
    assert str(err.value) == f"config error: {message}"


@pytest.mark.parametrize("remove, message", [
    (["model.safetensors"], "no weights (*.safetensors)"),
    (["tokenizer.json", "tokenizer_config.json"], "cannot load a tokenizer (Couldn't instantiate the backend tokenizer"),
    (["chat_template.jinja"], "the tokenizer has no chat template"),
])
def test_a_model_directory_without_a_part_is_named(tiny, tmp_path, remove, message):
    model = tmp_path / "model"
    shutil.copytree(tiny / "init", model)
    for name in remove:
        (model / name).unlink()
    with pytest.raises(ForgeError) as err:
        load_tokenizer(ModelConfig(path=str(model)))
    assert str(err.value).startswith(f"model error: model.path '{model}': {message}"), str(err.value)


@pytest.mark.parametrize("case", ["config", "model"])
def test_an_error_every_rank_finds_is_printed_once(tiny, tmp_path, case):
    """A config error (found before the process group exists) and a model directory without weights (found
    after, by every rank): one line for the 3-rank job, no traceback of ours."""
    model = tmp_path / "model"
    shutil.copytree(tiny / "init", model)
    (model / "model.safetensors").unlink()
    flags = ["--sampling.max_tokens", "0"] if case == "config" else ["--model.path", str(model)]
    message = "'sampling.max_tokens' must be greater than 0" if case == "config" else "no weights (*.safetensors)"
    proc = run_script("train_grpo.py", grpo_args(tiny, tmp_path / "out", *flags), nproc=3, check=False)
    assert_clean_error(proc, "train_grpo.py", message)
    assert proc.stderr.count(message) == 1 and "collective failed" not in proc.stderr, proc.stderr[-3000:]


def test_a_collective_that_fails_while_joining_the_group_is_one_line(tmp_path):
    """A rank still joining the process group when its peers have left (they all found a config error) fails
    before the store that says where the others were exists: one line, no traceback of ours."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.distributed as dist\n"
                     "from forge_core.dist import run_main\n"
                     "def main():\n"
                     "    raise dist.DistNetworkError('[/gloo/transport/tcp/pair.cc:1] Connection reset by peer')\n"
                     "run_main(main)\n")
    proc = run_script(str(probe), [], check=False)
    assert proc.returncode == 1
    assert "collective failed in phase start after 0 s: Connection reset by peer" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_an_error_one_rank_finds_is_printed(tmp_path):
    """Rank 2 alone finds an error while the others wait in a collective: its line is printed, and the
    others' "connection reset" that follows is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.distributed as dist\n"
                     "from forge_core.config import ForgeError\n"
                     "from forge_core.dist import init_dist, run_main\n"
                     "def main():\n"
                     "    if init_dist().rank == 2:\n"
                     "        raise ForgeError('data error: shard 2 is missing on this node')\n"
                     "    dist.barrier()\n"
                     "run_main(main)\n")
    proc = run_script(str(probe), [], nproc=3, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("[rank 2] data error: shard 2 is missing on this node") == 1, proc.stderr[-3000:]
    assert "collective failed" not in proc.stderr and 'File "' + str(probe) not in proc.stderr, proc.stderr[-3000:]
