"""Tensor parallelism in training (forge_core/tensor_parallel.py, `fsdp.tensor_parallel_size`): train_sft.py on a
tiny Qwen3 (grouped-query attention, per-head q/k norms, a tied head) on 2 ranks of tensor parallelism and on 2 x 2
(FSDP over 2 data-parallel blocks of 2 tensor-parallel ranks) against one process, resumed, and its config errors;
train_grpo.py's policy blocks of 2 tensor-parallel ranks against FSDP alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_clean_error, assert_same_curve, read_metrics, run_script

STEPS = 4


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_qwen3_tp")
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--arch", "qwen3", "--out", str(out),
                    "--num_layers", "2"], check=True, cwd=REPO, capture_output=True)
    return out


def sft(qwen3: Path, out_dir: Path, nproc: int, *extra: str, check: bool = True):
    return run_script("train_sft.py", [
        "--config", "configs/sft/tiny_qwen3.yaml", "--model.path", str(qwen3 / "init"),
        "--data.path", str(qwen3 / "data" / "train.jsonl"), "--data.eval_path", str(qwen3 / "data" / "eval.jsonl"),
        "--out_dir", str(out_dir), "--train.steps", str(STEPS), "--train.eval_every", "0", "--train.log_every", "1",
        "--data.eval_rows", "8", "--train.batch_size", "16", "--train.micro_batch_size", "4", "--fsdp.shard",
        "--ckpt.save_every", "2", *extra], nproc=nproc, check=check)


def test_tensor_parallel_training_is_one_process_training(qwen3, tmp_path):
    """The same AdamW steps (clipped at 1.0) on 1 rank, on 2 tensor-parallel ranks and on 2 x 2 give the same losses
    and gradient norms at every step and the same exported weights (the heads, q/k norms and the tied head included,
    to float rounding); the 2 x 2 run stopped at step 2 resumes onto its straight curve."""
    sft(qwen3, tmp_path / "one", 1)
    sft(qwen3, tmp_path / "tp", 2, "--fsdp.tensor_parallel_size", "2")
    sft(qwen3, tmp_path / "fsdp_tp", 4, "--fsdp.tensor_parallel_size", "2")
    one = read_metrics(tmp_path / "one")
    for run in ("tp", "fsdp_tp"):
        metrics = read_metrics(tmp_path / run)
        for step in range(1, STEPS + 1):
            for key in ("train/loss", "train/grad_norm"):
                assert metrics[step][key] == pytest.approx(one[step][key], rel=1e-5), (run, step, key)
        expected, got = (load_file(tmp_path / r / "hf" / "model.safetensors") for r in ("one", run))
        assert expected.keys() == got.keys()
        gap = max((expected[k] - got[k]).abs().max().item() for k in expected)
        assert gap < 1e-5, (run, gap)
        assert not torch.equal(expected["model.layers.0.self_attn.q_norm.weight"],
                               load_file(qwen3 / "init" / "model.safetensors")["model.layers.0.self_attn.q_norm.weight"])

    sft(qwen3, tmp_path / "split", 4, "--fsdp.tensor_parallel_size", "2", "--train.stop_at_step", "2")
    resumed = sft(qwen3, tmp_path / "split", 4, "--fsdp.tensor_parallel_size", "2")
    assert "resumed from" in resumed.stdout
    straight, split = read_metrics(tmp_path / "fsdp_tp"), read_metrics(tmp_path / "split")
    for step in range(3, STEPS + 1):
        for key in ("train/loss", "train/grad_norm"):
            assert split[step][key] == pytest.approx(straight[step][key], rel=1e-6, abs=1e-7), (step, key)


@pytest.mark.parametrize("nproc, tp, extra, message", [
    (3, 3, [], "fsdp.tensor_parallel_size=3 does not split the model's 4 attention heads evenly"),
    (2, 4, [], "fsdp.tensor_parallel_size=4 does not divide the 2 ranks (2 per node)"),
    (2, 2, ["--model.lora.rank", "4"], "fsdp.tensor_parallel_size=2 with model.lora.rank"),
])
def test_a_tensor_parallel_size_that_does_not_fit_is_a_config_error(qwen3, tmp_path, nproc, tp, extra, message):
    proc = sft(qwen3, tmp_path, nproc, "--fsdp.tensor_parallel_size", str(tp), *extra, check=False)
    assert_clean_error(proc, "train_sft.py", f"config error: {message}")


def grpo(qwen3: Path, out_dir: Path, nproc: int, *extra: str, check: bool = True):
    return run_script("train_grpo.py", [
        "--config", "configs/grpo/tiny_qwen3.yaml", "--model.path", str(qwen3 / "init"),
        "--data.path", str(qwen3 / "data" / "train.jsonl"), "--data.eval_path", str(qwen3 / "data" / "eval.jsonl"),
        "--out_dir", str(out_dir), "--train.steps", str(STEPS), "--train.eval_every", "0", "--data.eval_rows", "16",
        "--train.prompts_per_step", "8", "--train.micro_batch_size", "16", "--sampling.max_tokens", "6",
        "--optim.lr", "3e-3", "--rewards.functions", "tests/rewards_for_tests.py:digit_fraction", "--fsdp.shard",
        "--engine.tensor_parallel_size", "2", *extra], nproc=nproc, check=check)


@pytest.mark.parametrize("layout", [
    ["--layout.policy", "2", "--layout.reference", "1", "--layout.reward", "1", "--loss.beta", "0.04"],
    ["--layout.policy", "4", "--layout.reference", "0", "--layout.reward", "0"],
    ["--layout.policy", "2", "--layout.reference", "2", "--layout.reward", "0", "--loss.beta", "0.04"],
], ids=["tp2_with_scoring_ranks", "2x2_policy_only", "tp2_policy_and_reference"])
def test_tensor_parallel_grpo_is_fsdp_grpo(qwen3, tmp_path, layout):
    """Each engine's 2 ranks train as one tensor-parallel block on what it sampled (FSDP alone splits it between
    them): the same rewards, gradient norms, KL and entropy at every step, and the engine's logprobs equal the
    trainer's after each sync. One block with reward and reference ranks (its first rank alone sends the rollout
    and gets the scores for both), two blocks alone (FSDP over them, the rewards computed by each block's first
    rank), and a block of reference ranks beside the policy's (its KL terms)."""
    grpo(qwen3, tmp_path / "tp", 4, *layout, "--fsdp.tensor_parallel_size", "2")
    grpo(qwen3, tmp_path / "fsdp", 4, *layout)
    tp, fsdp = read_metrics(tmp_path / "tp"), read_metrics(tmp_path / "fsdp")
    assert_same_curve(tp, fsdp, range(1, STEPS + 1), ("reward/mean", "loss/entropy", "train/grad_norm", "loss/kl"))
    assert all(tp[step]["loss/logprob_gap"] < 1e-5 for step in range(1, STEPS + 1))
    assert tp[STEPS]["train/tokens"] == fsdp[STEPS]["train/tokens"]


@pytest.mark.parametrize("extra, message", [
    (["--layout.policy", "4", "--layout.reference", "0", "--layout.reward", "0", "--engine.tensor_parallel_size", "1"],
     "fsdp.tensor_parallel_size=2 does not divide engine.tensor_parallel_size=1"),
    (["--layout.policy", "3", "--layout.reference", "0", "--layout.reward", "1"],
     "fsdp.tensor_parallel_size=2 does not divide layout.policy=3"),
])
def test_a_grpo_tensor_parallel_size_that_does_not_fit_is_a_config_error(qwen3, tmp_path, extra, message):
    proc = grpo(qwen3, tmp_path, 4, "--fsdp.tensor_parallel_size", "2", *extra, check=False)
    assert_clean_error(proc, "train_grpo.py", f"config error: {message}")


def test_logprobs_of_logits_split_over_the_vocabulary_are_the_whole_ones():
    """Loss parallel: a tensor-parallel head's logits stay split over the vocabulary (each rank its columns) and
    `chosen_logprobs` joins each row's softmax by all-reduces; its logprobs, entropies and gradients equal those of the
    whole logits (37 columns over 2 ranks, chosen tokens on both; tests/vocab_parallel_check.py). The tiny tasks' tokens
    all lie in the first rank's columns, so the training parity above cannot tell."""
    proc = run_script("tests/vocab_parallel_check.py", [], nproc=2)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["ids_on_each_rank"], result
    assert result["picked_gap"] < 1e-5 and result["entropy_gap"] < 1e-4 and result["grad_gap"] < 1e-5, result


def test_sequence_parallel_layers_are_one_process_layers():
    """Sequence parallelism: between the layers each rank holds its share of the positions (7 and 6 of 13; of a
    one-position decode step rank 0 holds it) and the logits and every gradient equal one process's, for a dense
    Qwen3 and a Qwen3-MoE whose experts run whole on each rank (tests/sequence_parallel_check.py)."""
    proc = run_script("tests/sequence_parallel_check.py", [], nproc=2)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    for model in ("qwen3", "qwen3_moe"):
        assert result[model]["residual_stream"] == [["S(1)", 7], ["S(1)", 1]], result
        assert result[model]["logit_gap"] < 1e-5 and result[model]["relative_grad_gap"] < 1e-5, result
