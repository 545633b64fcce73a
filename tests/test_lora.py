"""LoRA (peft) for SFT and GRPO: the engine computes with the merged weights after every sync, only the adapter
trains, the checkpoints hold it alone and resume exactly, the tiny LoRA GRPO job learns, bad targets are named."""

import json

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import (HELD_OUT_ACCURACY, assert_clean_error, assert_same_curve, grpo_after_sft, read_metrics,
                      run_script, tiny_sft_args)


def test_engine_computes_with_the_merged_adapter_after_every_sync(tiny, tmp_path):
    """2 FSDP ranks, adapters on every linear layer, 3 optimizer steps each followed by a sync: the engine's
    weights equal W + scale * B @ A of the gathered model, its logprobs those of an HF model holding the merged
    weights (1e-5) and, to rounding, the adapted trainer's; the base weights are the file's, and the reference policy
    (the adapter switched off) computes the file's logprobs to rounding (FSDP's forward is not the plain model's)."""
    run_script("tests/lora_check.py", [str(tiny / "init"), str(tmp_path)], nproc=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["trained"] == 2 * 7 * 4 and result["trained_not_adapter"] == []
        assert result["weight_gaps"] == [0.0, 0.0, 0.0]
        assert max(result["logprob_gaps"]) < 1e-5, result["logprob_gaps"]
        assert max(result["adapted_gaps"]) < 1e-4, result["adapted_gaps"]
        assert result["base_unchanged"] and result["merged_changed"] == 7 * 4
        assert result["reference_gap"] < 1e-5 and result["adapted_gap"] > 1e-3, result


def test_sft_trains_only_the_adapter_and_exports_it_merged_and_alone(tiny, tmp_path):
    """A short LoRA SFT on 2 sharded ranks: the export is the base with W + scale * B @ A in the targeted weights
    (what peft's merge_and_unload of the exported adapter gives), every other weight is the start model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, "--train.steps", "4", "--train.eval_every", "0",
                                             "--fsdp.shard", "--model.lora.rank", "4",
                                             "--model.lora.target_modules", "q_proj", "v_proj",
                                             "--model.lora.save_adapter"), nproc=2)
    start, merged = load_file(tiny / "init" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    changed = sorted(k for k in start if not torch.equal(start[k], merged[k]))
    assert changed == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(4) for p in "qv")
    base = AutoModelForCausalLM.from_pretrained(tiny / "init", dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").merge_and_unload().state_dict()
    for key in changed:
        torch.testing.assert_close(peft_merged[key], merged[key], atol=1e-6, rtol=0)


def test_lora_grpo_learns_keeps_only_the_adapter_in_checkpoints_and_resumes(addition_sft, tmp_path):
    """configs/grpo/tiny_lora.yaml from the default pipeline's SFT model, shortened, with a KL term against the base
    (the adapter off, on the policy rank): held-out accuracy rises; the checkpoint holds the adapter alone, and a
    run resumed from it logs the straight run's numbers."""
    args = ("--loss.beta", "0.01", "--ckpt.save_every", "10")
    grpo = grpo_after_sft(addition_sft, tmp_path / "straight", "configs/grpo/tiny_lora.yaml", 15, *args)
    greedy_start, greedy_end, sampled_start, sampled_end, _ = map(float, HELD_OUT_ACCURACY.findall(grpo.stdout)[-1])
    assert greedy_end > greedy_start + 0.1 and sampled_end > sampled_start + 0.1, grpo.stdout[-600:]
    straight = read_metrics(tmp_path / "straight")
    assert straight[15]["loss/kl"] > 0
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_000010"
    saved = [k for k in FileSystemReader(checkpoint).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert saved and all(".lora_" in k for k in saved), saved[:3]
    grpo_after_sft(addition_sft, tmp_path / "resumed", "configs/grpo/tiny_lora.yaml", 15, *args,
                   "--ckpt.resume", str(checkpoint))
    assert_same_curve(read_metrics(tmp_path / "resumed"), straight, range(11, 16))


def test_a_target_module_that_matches_nothing_is_a_one_line_error(tiny, tmp_path):
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path, "--model.lora.rank", "4",
                                                    "--model.lora.target_modules", "q_proj", "qkv"), nproc=1, check=False)
    assert_clean_error(proc, "train_sft.py", "model.lora.target_modules ['qkv'] match no linear layer")


def test_lora_grpo_with_reference_ranks_is_a_config_error(tiny):
    proc = run_script("train_grpo.py", ["--config", "configs/grpo/tiny_lora.yaml", "--model.path", str(tiny / "init"),
                                        "--layout.reference", "1"], nproc=3, check=False)
    assert_clean_error(proc, "train_grpo.py", "the reference policy is the policy's own base",
                       "layout.reference must be 0")
