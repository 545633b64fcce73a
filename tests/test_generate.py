"""generate.py on an exported checkpoint: batch JSONL and interactive chat through a real vLLM engine."""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_clean_error, run_script
from forge_core.data import chat_prompt_ids, read_rows


def hf_greedy(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = []
    for prompt in prompts:
        ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def test_batch_greedy_equals_hf_and_chat_answers_each_turn(tiny, three_role_run, tmp_path):
    """Batch on 2 ranks, an engine each, with the rows dealt between them, and on one engine split over both
    (tensor parallel); chat in one process."""
    model = str(three_role_run / "hf")
    greedy = ["--model.path", model, "--sampling.temperature", "0", "--sampling.max_tokens", "8"]
    proc = run_script("generate.py", [*greedy, "--prompts", str(tiny / "data" / "eval.jsonl"), "--limit", "7",
                                      "--output", str(tmp_path / "out.jsonl")], nproc=2)
    assert f"wrote 7 rows to {tmp_path / 'out.jsonl'} (2 engines)" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in read_rows(str(tiny / "data" / "eval.jsonl"))[:7]]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["completions"][0] for r in rows] == hf_greedy(model, prompts, 8)
    tp = run_script("generate.py", [*greedy, "--prompts", str(tiny / "data" / "eval.jsonl"), "--limit", "7",
                                    "--engine.tensor_parallel_size", "2", "--output", str(tmp_path / "tp.jsonl")], nproc=2)
    assert f"wrote 7 rows to {tmp_path / 'tp.jsonl'} (1 engine)" in tp.stdout, tp.stdout
    assert [json.loads(line) for line in (tmp_path / "tp.jsonl").read_text().splitlines()] == rows   # one TP engine

    chat = run_script("generate.py", greedy, stdin=f"{prompts[0]}\n/reset\n{prompts[1]}\n/exit\n")
    replies = chat.stdout.strip().splitlines()
    assert replies == [rows[0]["completions"][0], rows[1]["completions"][0]], chat.stdout


def test_sampling_options_and_bad_input(tiny, three_role_run, tmp_path):
    model = str(three_role_run / "hf")
    proc = run_script("generate.py", ["--model.path", model, "--prompts", str(tiny / "data" / "eval.jsonl"),
                                      "--limit", "2", "--sampling.num_generations", "3", "--sampling.top_p", "0.9"])
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [len(r["completions"]) for r in rows] == [3, 3]
    missing = run_script("generate.py", ["--model.path", model, "--prompts", str(tmp_path / "nope.jsonl")], check=False)
    assert_clean_error(missing, "generate.py", f"data error: {tmp_path / 'nope.jsonl'}: no such file")
