"""The shipped pipelines, shortened, learn what they claim: `make run` (SFT imitates a careless teacher, GRPO
unlearns its slip) and `make run-agent` (SFT on a few calculator traces, GRPO learns that the tool pays)."""

import re
import subprocess
import sys

from conftest import REPO, read_metrics, run_script

ACCURACY = re.compile(r"held-out accuracy: greedy ([\d.]+) -> ([\d.]+) \(\d+ rows, s.e. [\d.]+\), "
                      r"sampled \(T=1, 8 per prompt\) ([\d.]+) -> ([\d.]+) \(step 0 -> (\d+)\)")


def _pipeline(tmp_path, task: str, sft_config: str, grpo_config: str, sft_steps: int, grpo_steps: int
              ) -> tuple[dict, subprocess.CompletedProcess]:
    data = tmp_path / "artifacts"
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny.py"), "--task", task, "--out", str(data)],
                   check=True, cwd=REPO, capture_output=True)
    paths = ["--data.path", str(data / "data" / "train.jsonl"), "--data.eval_path", str(data / "data" / "eval.jsonl")]
    run_script("train_sft.py", ["--config", sft_config, "--model.path", str(data / "init"), *paths,
                                "--train.steps", str(sft_steps), "--train.eval_every", "0", "--data.eval_rows", "16",
                                "--out_dir", str(tmp_path / "sft")], nproc=2)
    # GRPO on one rank: the policy scores its own samples, as reward ranks would
    # (test_grpo_e2e.py::test_reward_ranks_score_like_one_process)
    grpo = run_script("train_grpo.py", ["--config", grpo_config, "--model.path", str(tmp_path / "sft" / "hf"), *paths,
                                        "--train.steps", str(grpo_steps), "--train.eval_every", "0",
                                        "--data.eval_rows", "64", "--out_dir", str(tmp_path / "grpo"),
                                        "--layout.reference", "0", "--layout.reward", "0"], nproc=1)
    return read_metrics(tmp_path / "sft"), grpo


def test_default_pipeline_grpo_lifts_greedy_and_sampled_accuracy(tmp_path):
    sft, grpo = _pipeline(tmp_path, "addition", "configs/sft/tiny.yaml", "configs/grpo/tiny.yaml", 500, 15)
    assert sft[500]["train/loss"] < 0.6 * sft[20]["train/loss"]
    greedy_start, greedy_end, sampled_start, sampled_end, steps = map(float, ACCURACY.findall(grpo.stdout)[-1])
    assert greedy_start < 0.6, "SFT must leave GRPO room: it imitates the teacher's slips"
    assert greedy_end > greedy_start + 0.1 and sampled_end > sampled_start + 0.1, grpo.stdout[-600:]
    assert steps == 15 and "summary: 15 GRPO steps" in grpo.stdout


def test_calculator_pipeline_learns_to_use_the_tool(tmp_path):
    _, grpo = _pipeline(tmp_path, "calculator", "configs/sft/tiny_calculator.yaml", "configs/grpo/tiny_calculator.yaml",
                        300, 20)
    greedy_start, greedy_end, sampled_start, sampled_end, _ = map(float, ACCURACY.findall(grpo.stdout)[-1])
    tool_start, tool_end = map(float, re.findall(r"tool use: ([\d.]+) -> ([\d.]+) of episodes", grpo.stdout)[-1])
    assert greedy_end > greedy_start + 0.2 and sampled_end > sampled_start + 0.2, grpo.stdout[-600:]
    assert tool_end > tool_start + 0.2
    metrics = read_metrics(tmp_path / "grpo")
    assert metrics[20]["episode/tool_calls"] > metrics[1]["episode/tool_calls"]
    assert metrics[20]["episode/turns"] > 1.5
