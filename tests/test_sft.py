"""train_sft.py end to end under real torchrun process groups (gloo, CPU)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_clean_error, read_metrics, run_script, tiny_sft_args

SHORT = ["--train.steps", "6", "--train.batch_size", "8", "--train.micro_batch_size", "4", "--train.log_every", "1",
         "--train.eval_every", "0", "--data.eval_rows", "8", "--optim.warmup_steps", "2"]


def test_two_rank_fsdp_matches_one_process(tiny, tmp_path):
    """Two ranks, sharded (`--fsdp.shard`: FSDP) or replicated (DDP, what the tiny config says), learn as one
    process does; so do sharded ranks that keep their parameters, gradients, Adam's state (CPUOffloadPolicy) and
    activations (save_on_cpu) in host memory."""
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "one", *SHORT), nproc=1)
    # the sharded run also checkpoints activations: it must change memory, not numbers
    offloaded = ("--fsdp.shard", "--fsdp.cpu_offload", "--fsdp.activation_offload")
    for name, extra in (("sharded", ("--fsdp.shard", "--fsdp.activation_checkpointing")), ("replicated", ()),
                        ("offloaded", offloaded)):
        run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / name, *SHORT, *extra), nproc=2)
        one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / name)
        for step in range(1, 7):
            assert one[step]["train/loss"] == pytest.approx(two[step]["train/loss"], abs=1e-5), (name, step)
            assert one[step]["train/grad_norm"] == pytest.approx(two[step]["train/grad_norm"], rel=1e-4), (name, step)
        w1, w2 = (load_file(tmp_path / run / "hf" / "model.safetensors") for run in ("one", name))
        assert w1.keys() == w2.keys()
        for key in w1:
            torch.testing.assert_close(w1[key], w2[key], atol=2e-5, rtol=0, msg=f"{name} {key}")


def test_replicas_average_gradients_over_several_buckets_of_mixed_dtypes(tmp_path):
    """Replicated ranks all-reduce gradients in flat buckets: with buckets far smaller than the model, and
    fp32 and bf16 gradients mixed, every gradient ends as the ranks' mean, in its own shape and dtype."""
    probe = tmp_path / "probe.py"
    probe.write_text("""
import torch, torch.distributed as dist
import forge_core.optim as optim_module
from forge_core.dist import init_dist, run_main
def main():
    d = init_dist()
    optim_module.GRADIENT_BUCKET_BYTES = 1000
    shapes = [(7, 5), (3, 3), (300,), (3, 4), (2, 2, 2), (1,)]
    dtypes = [torch.float32] * 3 + [torch.bfloat16] * 2 + [torch.float32]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=t)) for s, t in zip(shapes, dtypes)]
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (d.rank + 1) + i
    optim_module._average_gradients(params, dist.group.WORLD)
    for i, p in enumerate(params):
        mean = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 1.5 + i
        torch.testing.assert_close(p.grad, mean.to(p.dtype), rtol=0, atol=0)
    if d.rank == 0:
        print("averaged in buckets of", [len(b) for b in optim_module._buckets([p.grad for p in params], 1000)])
run_main(main)  # leaves as the scripts do: the interpreter's teardown can abort a gloo rank
""")
    proc = run_script(str(probe), [], nproc=2)
    assert "averaged in buckets of [2, 1, 2, 1]" in proc.stdout, proc.stdout[-2000:]


def test_linear_kernels_give_the_same_losses(tiny, tmp_path):
    """fsdp.linear_kernel picks the CPU GEMMs (auto: by the CPU, test_model.py); oneDNN and torch's train alike."""
    runs = {}
    for kernel in ("onednn", "torch"):
        proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / kernel, *SHORT, "--fsdp.linear_kernel", kernel),
                          nproc=1)
        assert f"CPU GEMMs: {kernel};" in proc.stdout
        runs[kernel] = read_metrics(tmp_path / kernel)
    for step in range(1, 7):
        assert runs["onednn"][step]["train/loss"] == pytest.approx(runs["torch"][step]["train/loss"], abs=1e-5), step


def test_resume_reproduces_the_uninterrupted_run(tiny, tmp_path):
    args = [*SHORT, "--train.steps", "8", "--ckpt.save_every", "4"]
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "straight", *args), nproc=2)
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "split", *args, "--train.stop_at_step", "4"), nproc=2)
    assert not (tmp_path / "split" / "hf").exists(), "a preempted run must not export final weights"
    resumed = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "split", *args), nproc=2)
    assert "resumed from" in resumed.stdout
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    for step in range(5, 9):
        for key in ("train/loss", "train/lr", "train/grad_norm"):
            assert split[step][key] == pytest.approx(straight[step][key], rel=1e-6, abs=1e-7), (step, key)
    assert split[8]["eval/loss"] == pytest.approx(straight[8]["eval/loss"], rel=1e-6)
    assert "eval/loss" in split[4] and "eval/loss" not in straight[4], "a stopped run evaluates at its last step"

    shorter = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "split", *SHORT, "--train.steps", "6"),
                         nproc=1, check=False)          # the finished run's directory, with fewer steps
    assert_clean_error(shorter, "train_sft.py", "config error: train.steps=6 ends before the step-8 checkpoint")


def test_packing_gives_the_same_loss(tiny, tmp_path):
    args = [*SHORT, "--train.steps", "2"]
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "padded", *args))
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "packed", *args, "--data.pack"))
    padded, packed = read_metrics(tmp_path / "padded"), read_metrics(tmp_path / "packed")
    for step in (1, 2):
        assert packed[step]["train/loss"] == pytest.approx(padded[step]["train/loss"], abs=1e-5)


def test_exported_weights_load_in_transformers_with_the_trainers_logits(tiny, tmp_path):
    """The HF export and the DCP checkpoint of the same step hold the same model: same logits."""
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, *SHORT, "--train.steps", "3"), nproc=2)
    check = f"""
import torch, sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {str(tmp_path)!r}
dcp_to_torch_save(out + "/checkpoints/step_000003", out + "/trainer.pt")
trainer_state = torch.load(out + "/trainer.pt", weights_only=True)["model"]
exported = AutoModelForCausalLM.from_pretrained(out + "/hf")
assert exported.config.architectures == ["LlamaForCausalLM"], exported.config.architectures
trainer = AutoModelForCausalLM.from_pretrained({str(tiny / "init")!r})
trainer.load_state_dict(trainer_state)
tok = AutoTokenizer.from_pretrained(out + "/hf")
ids = tok(["12+34=", "999+1="], return_tensors="pt", padding=True)
with torch.no_grad():
    a, b = exported(**ids).logits, trainer(**ids).logits
assert not torch.equal(trainer.model.embed_tokens.weight, AutoModelForCausalLM.from_pretrained({str(tiny / "init")!r}).model.embed_tokens.weight)
torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# ---- bad input: one clear line, exit code 2, nothing written ----

def _fails_cleanly(proc, *fragments: str) -> None:
    assert_clean_error(proc, "train_sft.py", *fragments)


@pytest.mark.parametrize("override, fragments", [
    (["--data.path", "/nonexistent/train.jsonl"], ["data error: /nonexistent/train.jsonl: no such file"]),
    (["--model.path", "/nonexistent/model"], ["model error: model.path '/nonexistent/model': no such directory"]),
    pytest.param(["--model.attention", "flex_attention"], ["config error: model.attention=flex_attention needs a GPU"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only error")),
    (["--model.router_aux_loss", "0.01"], ["config error: model.router_aux_loss is set, but model.path",
                                           "is not a Mixture-of-Experts model"]),
])
def test_missing_paths_and_settings_the_model_cannot_take_are_clear_errors(tiny, tmp_path, override, fragments):
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "out", *override), check=False)
    assert proc.returncode == 2
    _fails_cleanly(proc, *fragments)
    assert not (tmp_path / "out").exists()


def test_row_without_a_field_is_named(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}] * 16 + [{"question": "2+2=", "solution": "4"}]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "out", "--data.path", str(bad)), check=False)
    assert proc.returncode == 2
    _fails_cleanly(proc, f"data error: {bad} row 17: no 'prompt' field (has: question, solution)")


def test_unknown_and_mistyped_config_keys(tiny, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("optim:\n  lrr: 0.1\n")
    proc = run_script("train_sft.py", ["--config", str(config)], check=False)
    _fails_cleanly(proc, f"config error: {config}: unknown key 'optim.lrr' (did you mean 'optim.lr'?)")
    config.write_text("train:\n  steps: many\n")
    proc = run_script("train_sft.py", ["--config", str(config)], check=False)
    _fails_cleanly(proc, f"config error: {config}: 'train.steps' expects int, got 'many'")


def test_world_size_that_does_not_divide_the_batch(tiny, tmp_path):
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "out", *SHORT), nproc=3, check=False)
    _fails_cleanly(proc, "config error: train.batch_size=8 must be a multiple of train.micro_batch_size=4 x 3 ranks")
    assert not (tmp_path / "out").exists()
