"""bench/bench_grpo.py runs through on a few steps (without its TRL peer, which needs a venv of its own): the
benchmark is how the issue's targets are measured, and a crash in one of its workers went unseen once."""

import json

import yaml

from conftest import REPO, run_script


def test_grpo_bench_prints_its_tables(tiny, tmp_path):
    config = yaml.safe_load((REPO / "configs" / "grpo" / "tiny.yaml").read_text())
    config["data"] |= {"path": str(tiny / "data" / "train.jsonl"), "eval_path": str(tiny / "data" / "eval.jsonl"),
                       "eval_rows": 64}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    proc = run_script("bench/bench_grpo.py", ["--config", str(tmp_path / "grpo.yaml"), "--model", str(tiny / "init"),
                                              "--no_trl", "--steps", "4", "--warmup_steps", "1", "--sync_steps", "4",
                                              "--repeats", "8"])
    for row in ("| time/step (wall clock) |", "| generation |", "| weight sync, 2 policy ranks",
                "| held-out sampled (T=1, G per prompt) accuracy after 4 steps"):
        assert row in proc.stdout, row
    raw = json.loads(proc.stdout.split("raw numbers: ")[1].splitlines()[0])
    assert raw["ours"]["time/step"] > 0 and raw["vllm"]["tokens_per_s"] > 0 and raw["broadcast"]["seconds"] > 0
    for key in ("accuracy", "accuracy_sampled"):
        assert 0 <= raw[key]["start"] <= 1 and 0 <= raw[key]["ours"] <= 1


def test_gemm_bench_prints_every_linear(tiny):
    proc = run_script("bench/bench_gemm.py", ["--model", str(tiny / "init"), "--tokens", "64"], timeout=300)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "| 64 |" in line]
    assert [row.split()[1] for row in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert all(float(cell) > 0 for row in rows for cell in row.strip("| ").split(" | ")[2:]), rows


def test_agent_bench_prints_the_cost_of_turns(tmp_path):
    """bench/bench_agent.py on a few steps of the calculator job from an untrained model (its episodes are short)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--task", "calculator", "--out",
                    str(tmp_path / "calc")], check=True, cwd=REPO, capture_output=True)
    config = yaml.safe_load((REPO / "configs" / "grpo" / "tiny_calculator.yaml").read_text())
    config["data"] |= {"path": str(tmp_path / "calc" / "data" / "train.jsonl"),
                       "eval_path": str(tmp_path / "calc" / "data" / "eval.jsonl")}
    (tmp_path / "calc.yaml").write_text(yaml.safe_dump(config))
    proc = run_script("bench/bench_agent.py", ["--config", str(tmp_path / "calc.yaml"), "--model",
                                               str(tmp_path / "calc" / "init"), "--steps", "3", "--warmup_steps", "1"])
    assert "| turn loop (" in proc.stdout and "| single-turn generate," in proc.stdout
    raw = json.loads(proc.stdout.split("raw numbers: ")[1].splitlines()[0])
    assert raw["ours"]["perf/generate_tokens_per_s"] > 0 and raw["single_turn"]["tokens_per_s"] > 0


def test_reward_bench_prints_inline_against_the_pool():
    proc = run_script("bench/bench_rewards.py", ["--completions", "40", "--repeats", "1"], timeout=300)
    for row in ("| inline, one call after another (before) |", "| FunctionPool, 1 worker |",
                "| FunctionPool, 2 workers |"):
        assert row in proc.stdout, row
    raw = json.loads(proc.stdout.split("raw numbers: ")[1].splitlines()[0])
    assert raw["completions"] == 40 and all(s > 0 for s in raw["seconds"].values())


def test_mask_bench_prints_the_three_layouts(tiny):
    proc = run_script("bench/bench_mask.py", ["--model", str(tiny / "init"), "--completion-tokens", "16",
                                              "--prompt-tokens", "8", "--repeats", "1",
                                              "--attention-completion-tokens", "32"], timeout=300)
    for row in ("| packed, dense mask |", "| packed, causal only |", "| unpacked |", "attention fwd+bwd, one row of"):
        assert row in proc.stdout, row
