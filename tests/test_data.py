"""Data loading: local files, a `datasets` directory in GSM8K's own format, chat encoding, rewards."""

import json
import random
import re
from pathlib import Path

import pytest

import rewards
from forge_core.config import ForgeError
from forge_core.data import (IGNORE, DataConfig, chat_prompt_ids, collate_sft, encode_sft, label_assistant_turns,
                             micro_batches, read_rows, sample_indices)
from forge_core.model import turn_end

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
]


def test_gsm8k_format_through_datasets_and_parquet(tmp_path):
    gsm8k = tmp_path / "gsm8k"
    gsm8k.mkdir()
    for split in ("train", "test"):
        (gsm8k / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    rows = read_rows(str(gsm8k), split="test")
    assert rows == GSM8K_ROWS
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), tmp_path / "train.parquet")
    assert read_rows(str(tmp_path / "train.parquet")) == GSM8K_ROWS
    assert [rewards.gsm8k_correct(c, r) for c, r in zip(["so 72 clips", "#### 10.0"], rows)] == [1.0, 1.0]
    assert rewards.math_correct("The answer is \\boxed{72}", rows[0]) == 1.0
    assert rewards.gsm8k_correct("I think 71", rows[0]) == 0.0


GSM8K_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gsm8k"     # openai/gsm8k's layout, config "main"


def test_gsm8k_fixture_through_datasets_with_its_config():
    """The hub layout (README configs + main/{split}-*.parquet) loads by split and subset, as openai/gsm8k would;
    its calculator annotations hold, and both math rewards accept the gold answers."""
    train, test = read_rows(str(GSM8K_FIXTURE), "train", "main"), read_rows(str(GSM8K_FIXTURE), "test", "main")
    assert (len(train), len(test)) == (4, 3) and train[:2] == GSM8K_ROWS
    for row in train + test:
        assert set(row) == {"question", "answer"} and re.search(r"\n#### \d+$", row["answer"]), row
        for expr, value in re.findall(r"<<([^=>]+)=([^>]+)>>", row["answer"]):
            assert eval(expr, {"__builtins__": {}}) == pytest.approx(float(value)), expr
        gold = row["answer"].split("####")[-1].strip()
        assert rewards.gsm8k_correct(row["answer"], row) == 1.0
        assert rewards.math_correct(f"So the answer is {gold}.", row) == 1.0
        assert rewards.math_correct(f"So the answer is {int(gold) + 1}.", row) == 0.0
    shard = GSM8K_FIXTURE / "main" / "test-00000-of-00001.parquet"
    assert read_rows(str(shard)) == test                                  # one shard as a plain file


def test_bad_json_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": oops}\n')
    with pytest.raises(ForgeError, match=f"data error: {bad} line 2: not valid JSON"):
        read_rows(str(bad))
    with pytest.raises(ForgeError, match="is neither a local file nor a loadable data set"):
        read_rows(str(tmp_path / "no_such_dataset_dir"))


def test_response_only_labels_and_packing(tiny):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny / "init")
    end = turn_end(tok).ids[0]
    ids, labels, truncated = encode_sft(tok, chat_prompt_ids(tok, "12+34="), "46", max_length=64, end_id=end)
    assert not truncated
    trained = [t for t in labels if t != IGNORE]
    assert tok.decode(trained) == "46<|im_end|>"
    assert ids[-len(trained):] == trained
    assert tok.decode(ids[:-len(trained)]) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    examples = [encode_sft(tok, chat_prompt_ids(tok, p), r, 64, end)[:2]
                for p, r in [("1+1=", "2"), ("10+10=", "20"), ("5+5=", "10")]]
    packed = collate_sft(examples, tok.pad_token_id, pack=True, max_length=64)
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    assert (packed["position_ids"][0] == 0).sum() == 3    # every example restarts its positions


def test_sft_trains_the_templates_end_of_turn_not_eos(tiny):
    """A Llama-3-style template ends an assistant turn with <|eot_id|> and its EOS is <|end_of_text|>: SFT trains
    the model to end its answers where the template (and the engine, which stops there) ends a turn."""
    from test_env import LLAMA3_TEMPLATE
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny / "init")
    tok.add_special_tokens({"eos_token": "<|end_of_text|>",
                            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3_TEMPLATE
    _, labels, _ = encode_sft(tok, chat_prompt_ids(tok, "12+34="), "46", max_length=64, end_id=turn_end(tok).ids[0])
    assert tok.decode([t for t in labels if t != IGNORE]) == "46<|eot_id|>"


def test_every_assistant_turn_of_a_conversation_is_trained_where_the_model_generated_it(tiny):
    """data.every_assistant_turn: a game's conversation as one row trains each earlier move (with its end of turn)
    at the tokens the engine saw, as one row per move would; a template that rewrites earlier turns is refused."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny / "init")
    end = turn_end(tok).ids[0]
    talk = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "10+10="}, {"role": "assistant", "content": "20"}, {"role": "user", "content": "5+5="}]
    ids, labels, _ = encode_sft(tok, chat_prompt_ids(tok, talk), "10", 64, end)
    assert label_assistant_turns(tok, talk, ids, labels, end) is None
    runs, run = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token
            run.append(token)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    assert runs + [tok.decode(run)] == ["2<|im_end|>", "20<|im_end|>", "10<|im_end|>"]
    for k, move in ((1, "2"), (3, "20")):        # the per-move row: the same tokens before the move
        per_move, *_ = encode_sft(tok, chat_prompt_ids(tok, talk[:k]), move, 64, end)
        assert ids[:len(per_move)] == per_move
    cut = [IGNORE] * 12                          # a conversation cut by data.max_length: its turns up to the cut
    assert label_assistant_turns(tok, talk, ids[:12], cut, end) is None and cut == labels[:12]
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}" \
        "={% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ids, labels, _ = encode_sft(tok, chat_prompt_ids(tok, talk), "10", 64, end)
    assert label_assistant_turns(tok, talk, ids, labels, end) == \
        "message 2 (assistant) is not where the chat template puts the conversation's turns"
    from train_sft import encode_row
    rows = [{"prompt": talk[:1], "response": "2"}, {"prompt": talk, "response": "10"}]
    with pytest.raises(ForgeError, match=r"^data error: games.jsonl row 2: prompt's message 2 \(assistant\) is not "
                                         r"where .* \(data.every_assistant_turn\)$"):
        encode_row(tok, rows[1], None, DataConfig(every_assistant_turn=True), end, (rows, "games.jsonl"))


def test_sample_stream_is_a_function_of_the_step():
    first_epoch = [i for step in range(5) for i in sample_indices(step, 4, 20, seed=0)]
    assert sorted(first_epoch) == list(range(20))           # an epoch visits every row once
    assert sample_indices(7, 4, 20, seed=0) == sample_indices(7, 4, 20, seed=0)
    assert sample_indices(5, 4, 20, seed=0) != sample_indices(0, 4, 20, seed=0)


def test_micro_batches_spare_the_slowest_rank_padding():
    """train_sft.py deals each global batch over ranks and micro-batches by length: every example once, every rank
    its number of non-empty micro-batches, and the slowest rank's padded tokens (rows x longest, summed over its
    micro-batches; packed: tokens) well below those of the strided deal it replaced, on random lengths."""
    lengths = [10, 3, 7, 7, 2, 9, 1, 8]            # strided: [10, 7, 2, 1] pads to 40 tokens, [3, 7, 9, 8] to 36
    assert micro_batches(lengths, 2, 1, pack=False) == [[[2, 3, 1, 4, 6]], [[0, 5, 7]]]      # 35 and 30
    rng, ratios = random.Random(0), {False: [], True: []}
    for _ in range(400):
        ranks, per_rank, pack = rng.randint(1, 4), rng.randint(1, 3), rng.random() < 0.5
        n = ranks * per_rank * rng.randint(1, 6)
        lengths = [rng.randint(1, 300) for _ in range(n)]
        dealt = micro_batches(lengths, ranks, per_rank, pack)
        assert [len(mine) for mine in dealt] == [per_rank] * ranks and all(mb for mine in dealt for mb in mine)
        assert sorted(i for mine in dealt for mb in mine for i in mb) == list(range(n))
        cost = (lambda mb: sum(lengths[i] for i in mb)) if pack else (lambda mb: len(mb) * max(lengths[i] for i in mb))
        size = n // ranks // per_rank
        strided = [[list(range(r, n, ranks))[k * size:(k + 1) * size] for k in range(per_rank)] for r in range(ranks)]
        ratios[pack].append(max(sum(map(cost, mine)) for mine in dealt) /
                            max(sum(map(cost, mine)) for mine in strided))
    assert max(ratios[False] + ratios[True]) < 1.1
    assert sum(ratios[False]) / len(ratios[False]) < 0.8 and sum(ratios[True]) / len(ratios[True]) < 0.95
