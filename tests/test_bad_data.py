"""Bad data rows end in one line naming the file and the row (invalid UTF-8; a prompt or response that is not
text), or, when a prompt leaves no room for what must follow it, are skipped and counted (and when none is left,
one line names the file and the limit). Without these checks: a raw UnicodeDecodeError, a number formatted as
text and trained on, a ZeroDivisionError after the model loaded, vLLM's validation traceback."""

import json
import re
from pathlib import Path

import pytest

from conftest import assert_clean_error, grpo_args, run_script, tiny_sft_args
from forge_core.config import ForgeError
from forge_core.data import (IGNORE, DataConfig, chat_prompt_ids, drop_long_prompts, read_rows, require_fields,
                             require_text)
from forge_core.engine import EngineConfig, context_length
from forge_core.model import ModelConfig, load_tokenizer
from generate import GenerateConfig, batch_prompts
from train_sft import load_examples

LONG = "9" * 40       # 48 tokens in the tiny tokenizer's chat template; "12+45=" is 14


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_invalid_utf8_and_json_name_the_line(tmp_path):
    lines, array = tmp_path / "bad.jsonl", tmp_path / "bad.json"
    lines.write_bytes(b'{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "caf\xe9", "response": "3"}\n')
    array.write_bytes(b'[\n  {"prompt": "1+1="},\n  {"prompt": "caf\xe9"}\n]\n')
    for path in (lines, array):
        with pytest.raises(ForgeError, match=f"^data error: {re.escape(str(path))} line 3: not valid UTF-8$"):
            read_rows(str(path))
    array.write_text('[\n  {"prompt": "1+1="},\n  oops\n]\n')
    with pytest.raises(ForgeError, match=f"^data error: {re.escape(str(array))} line 3: not valid JSON"):
        read_rows(str(array))
    array.write_text('[{"prompt": "1+1="}, 7]')
    with pytest.raises(ForgeError, match=f"^data error: {re.escape(str(array))} row 2: expected a JSON object"):
        read_rows(str(array))


MESSAGES = 'a string or a list of {"role": string, "content": string} messages'


@pytest.mark.parametrize("prompt, complaint", [
    (7, f"'prompt' is 7 (a number): expected {MESSAGES}"),
    (None, "'prompt' is null"),
    ({"text": "1+1="}, f"""'prompt' is {{"text": "1+1="}} (an object): expected {MESSAGES}"""),
    ([], f"'prompt' is [] (an empty list): expected {MESSAGES}"),
    (["1+1=", "2+2="], """'prompt' message 1 is "1+1=": expected {"role": string, "content": string}"""),
    ([{"role": "user", "content": "1+1="}, {"role": "user"}],
     """'prompt' message 2 is {"role": "user"}: expected {"role": string, "content": string}"""),
    ([{"role": "user", "content": 5}], """'prompt' message 1 is {"role": "user", "content": 5}: expected"""),
])
def test_prompt_that_is_not_text_names_the_row_and_field(prompt, complaint):
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2"}, {"prompt": prompt, "response": "3"}]
    with pytest.raises(ForgeError, match=f"^{re.escape(f'data error: data.jsonl row 2: {complaint}')}"):
        require_fields(rows, ["prompt", "response"], "data.jsonl")
        require_text(rows, "prompt", "data.jsonl", messages=True)
    with pytest.raises(ForgeError, match=re.escape("data error: data.jsonl row 1: 'prompt' is [{")):
        require_text(rows, "prompt", "data.jsonl")          # a response must be a string


def test_drop_long_prompts_keeps_the_order_and_names_the_first():
    rows = [{"prompt": str(i)} for i in range(5)]
    ids = [[0] * n for n in (3, 9, 4, 10, 5)]
    warnings: list[str] = []
    assert drop_long_prompts(rows, ids, 5, "p.jsonl", "why", warnings.append) == ([rows[0], rows[2], rows[4]],
                                                                                  [ids[0], ids[2], ids[4]])
    assert warnings == ["data warning: p.jsonl: skipped 2 of 5 rows whose prompt is longer than 5 tokens (why); "
                        "the first is row 2 (9 tokens)"]
    assert drop_long_prompts(rows, ids, 10, "p.jsonl", "why", warnings.append) == (rows, ids) and len(warnings) == 1
    with pytest.raises(ForgeError, match=r"^data error: p.jsonl: every prompt is longer than 2 tokens \(why\); "
                                         r"the shortest has 3$"):
        drop_long_prompts(rows, ids, 2, "p.jsonl", "why", warnings.append)


def test_context_is_the_engines_or_the_models(tiny):
    model = ModelConfig(path=str(tiny / "init"))
    assert context_length(EngineConfig(), model) == 128                # build_tiny: 128 positions
    assert context_length(EngineConfig(max_model_len=32), model) == 32


# ---- train_sft.py ----

def test_sft_skips_rows_whose_prompt_fills_max_length_and_rejects_what_is_not_text(tiny, tmp_path):
    tokenizer = load_tokenizer(ModelConfig(path=str(tiny / "init")))
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "response": "2"}
                                                   for p in ("1+1=", LONG, "2+2=", LONG)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p, "response": "6"} for p in (LONG, "3+3=")])
    cfg = DataConfig(path=str(train), eval_path=str(held_out), max_length=32)
    examples, eval_rows, cuts = load_examples(cfg, tokenizer)
    assert len(examples) == 2 and all(set(labels[1:]) != {IGNORE} for _, labels in examples)
    assert [r["prompt"] for r in eval_rows] == ["3+3="]
    why = "data.max_length=32 leaves no response token to train on"
    assert cuts.warnings == [
        f"data warning: {train}: skipped 2 of 4 rows whose prompt is longer than 31 tokens ({why}); the first is row 2 "
        "(48 tokens)",
        f"data warning: {held_out}: skipped 1 of 2 rows whose prompt is longer than 31 tokens ({why}); the first is "
        "row 1 (48 tokens)"]

    cfg.max_length = 8
    with pytest.raises(ForgeError, match=re.escape(f"data error: {train}: every prompt is longer than 7 tokens "
                                                   "(data.max_length=8 leaves no response token to train on)")):
        load_examples(cfg, tokenizer)
    cfg.max_length = 32
    write_jsonl(train, [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": 4}])
    with pytest.raises(ForgeError, match=re.escape(f"data error: {train} row 2: 'response' is 4 (a number): "
                                                   "expected a string")):
        load_examples(cfg, tokenizer)


def test_sft_whose_every_row_is_too_long_stops_before_the_model_loads(tiny, tmp_path):
    proc = run_script("train_sft.py", tiny_sft_args(tiny, tmp_path / "out", "--data.max_length", "8"), check=False)
    assert proc.returncode == 2
    assert_clean_error(proc, "train_sft.py", f"data error: {tiny / 'data' / 'train.jsonl'}: every prompt is longer "
                                             "than 7 tokens (data.max_length=8 leaves no response token to train on)")


# ---- train_grpo.py and generate.py: prompts the engine cannot fit ----

def test_grpo_skips_prompts_the_engine_cannot_fit_and_stops_when_none_is_left(tiny, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": LONG if i == 8 else f"{i}+1=", "answer": str(i + 1)}
                                                   for i in range(16)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": LONG, "answer": "1"}] * 2)
    proc = run_script("train_grpo.py", grpo_args(tiny, tmp_path / "out", "--data.path", str(train), "--data.eval_path",
                                                 str(held_out), "--layout.reference", "0", "--layout.reward", "0",
                                                 "--engine.max_model_len", "32"), nproc=1, check=False)
    why = "the engine's 32-token context less sampling.max_tokens=6"
    assert_clean_error(proc, "train_grpo.py", f"data error: {held_out}: every prompt is longer than 26 tokens ({why})")
    assert (f"data warning: {train}: skipped 1 of 16 rows whose prompt is longer than 26 tokens ({why}); the first "
            "is row 9 (48 tokens)") in proc.stdout, proc.stdout[-3000:]


def test_generate_leaves_out_prompts_without_room_for_an_answer(tiny, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1="}, {"prompt": LONG},
                                                       {"prompt": [{"role": "user", "content": "2+2="}]}])
    cfg = GenerateConfig(model=ModelConfig(path=str(tiny / "init")), prompts=str(prompts), system="Add.",
                         engine=EngineConfig(max_model_len=32))
    tokenizer = load_tokenizer(cfg.model)
    warnings: list[str] = []
    rows, ids = batch_prompts(cfg, tokenizer, warnings.append)
    system = [{"role": "system", "content": "Add."}]
    assert rows == [{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "2+2="}]}]
    assert ids == [chat_prompt_ids(tokenizer, system + [{"role": "user", "content": p}]) for p in ("1+1=", "2+2=")]
    assert warnings == [f"data warning: {prompts}: skipped 1 of 3 rows whose prompt is longer than 31 tokens (the "
                        "engine's 32-token context leaves no room for an answer); the first is row 2 (61 tokens)"]
    cfg.engine.max_model_len = 16
    with pytest.raises(ForgeError, match=re.escape(f"data error: {prompts}: every prompt is longer than 15 tokens")):
        batch_prompts(cfg, tokenizer, warnings.append)
    write_jsonl(prompts, [{"prompt": "1+1="}, {"prompt": 7}])
    with pytest.raises(ForgeError, match=re.escape(f"data error: {prompts} row 2: 'prompt' is 7 (a number)")):
        batch_prompts(cfg, tokenizer, warnings.append)


def test_chat_leaves_out_a_message_the_engine_cannot_fit(tiny):
    chat = run_script("generate.py", ["--model.path", str(tiny / "init"), "--engine.max_model_len", "32",
                                      "--sampling.temperature", "0", "--sampling.max_tokens", "2"],
                      stdin=f"1+1=\n{LONG}\n2+2=\n/exit\n")
    assert chat.stderr.count("tokens and the engine holds 32 (/reset starts a new one)") == 1, chat.stderr[-3000:]
    assert "Traceback" not in chat.stderr
