"""The Qwen3 architecture that the GPU configs name (grouped-query attention, q/k norms) at tiny size, built
locally (tools/build_tiny.py --arch qwen3): weight sync into vLLM, SFT, GRPO with the colocated engine, resume
and export, as configs/{sft,grpo}/tiny_qwen3.yaml run them."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_same_curve, read_metrics, run_script

STEPS = 8


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_qwen3")
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--arch", "qwen3", "--out", str(out)],
                   check=True, cwd=REPO, capture_output=True)
    config = json.loads((out / "init" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["num_key_value_heads"] < config["num_attention_heads"]
    return out


def data_args(qwen3: Path) -> list[str]:
    return ["--data.path", str(qwen3 / "data" / "train.jsonl"), "--data.eval_path", str(qwen3 / "data" / "eval.jsonl")]


def grpo_args(qwen3: Path, model: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["--config", "configs/grpo/tiny_qwen3.yaml", "--model.path", str(model), *data_args(qwen3),
            "--out_dir", str(out_dir), "--train.steps", str(STEPS), "--train.eval_every", "0", "--data.eval_rows", "16",
            "--train.prompts_per_step", "8", "--sampling.max_tokens", "6", "--optim.lr", "3e-3",
            "--rewards.functions", "tests/rewards_for_tests.py:digit_fraction", "--ckpt.save_every", "4",
            "--layout.reference", "0", "--layout.reward", "0", *extra]


def test_synced_engines_equal_the_qwen3_trainer(qwen3, tmp_path):
    """2 FSDP ranks: after an update each engine holds the trainer's Qwen3 weights bit for bit (q/k norms,
    grouped k/v projections fused into qkv), decodes greedily like HF and gives the trainer's logprobs."""
    run_script("tests/sync_check.py", [str(qwen3 / "init"), str(tmp_path)], nproc=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["changed"] and result["fresh_mismatched"] == [] and result["mismatched"] == []
        assert result["vllm_greedy"] == result["hf_greedy"]
        assert result["logprob_gap"] < 1e-5


def test_qwen3_sft_then_grpo_resumes_and_exports(qwen3, tmp_path):
    """SFT (2 ranks) exports a Qwen3 that GRPO (1 rank: the roles are tested on Llama) trains: the engine's
    logprobs equal the trainer's at every step, a run stopped at step 4 resumes onto the straight run's curve, and
    the export is a Qwen3 whose q/k norms were trained."""
    run_script("train_sft.py", ["--config", "configs/sft/tiny_qwen3.yaml", "--model.path", str(qwen3 / "init"),
                                *data_args(qwen3), "--out_dir", str(tmp_path / "sft"), "--train.steps", "40",
                                "--train.eval_every", "0", "--data.eval_rows", "16"], nproc=2)
    sft = read_metrics(tmp_path / "sft")
    assert sft[40]["train/loss"] < 0.8 * sft[20]["train/loss"]
    model = tmp_path / "sft" / "hf"

    straight = run_script("train_grpo.py", grpo_args(qwen3, model, tmp_path / "straight"), nproc=1)
    assert "held-out accuracy: greedy" in straight.stdout
    metrics = read_metrics(tmp_path / "straight")
    assert all(metrics[s]["loss/logprob_gap"] < 1e-5 for s in range(1, STEPS + 1)), metrics[STEPS]

    split = grpo_args(qwen3, model, tmp_path / "split")
    run_script("train_grpo.py", [*split, "--train.stop_at_step", "4"], nproc=1)
    resumed = run_script("train_grpo.py", split, nproc=1)
    split_metrics = read_metrics(tmp_path / "split")
    assert_same_curve(split_metrics, metrics, range(5, STEPS + 1))
    # the stopped run measured its last step's weights, as the resumed run did at its start
    resumed_start = re.search(r"held-out accuracy at step 4: ([\d.]+) greedy", resumed.stdout)
    assert resumed_start and float(resumed_start[1]) == pytest.approx(split_metrics[4]["eval/accuracy"], abs=5e-4)

    config = json.loads((tmp_path / "straight" / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    before, after = load_file(model / "model.safetensors"), load_file(tmp_path / "straight" / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert not torch.equal(before["model.layers.0.self_attn.q_norm.weight"],
                           after["model.layers.0.self_attn.q_norm.weight"])
