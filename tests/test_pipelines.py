"""The default pipeline, shortened, learns what it claims: `make run` (SFT imitates a careless teacher, GRPO
unlearns its slip). The agentic one (`make run-agent`) is in test_agentic.py, so that xdist can run these two long
tests side by side (a file stays on one worker)."""

from conftest import HELD_OUT_ACCURACY, grpo_after_sft, read_metrics


def test_default_pipeline_grpo_lifts_greedy_and_sampled_accuracy(addition_sft, tmp_path):
    sft = read_metrics(addition_sft / "sft")
    grpo = grpo_after_sft(addition_sft, tmp_path, "configs/grpo/tiny.yaml", 15)
    assert sft[500]["train/loss"] < 0.6 * sft[20]["train/loss"]
    greedy_start, greedy_end, sampled_start, sampled_end, steps = map(float, HELD_OUT_ACCURACY.findall(grpo.stdout)[-1])
    assert greedy_start < 0.6, "SFT must leave GRPO room: it imitates the teacher's slips"
    assert greedy_end > greedy_start + 0.1 and sampled_end > sampled_start + 0.1, grpo.stdout[-600:]
    assert steps == 15 and "summary: 15 GRPO steps" in grpo.stdout
