"""Rows in (JSONL / Parquet / a `datasets` name), token ids out: chat template, response-only labels,
optional packing, and a step-indexed sample stream that makes resuming exact (position = step).

Also the synthetic verifiable task the tiny default job learns: addition.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import PositiveInt

from .config import ForgeError

__all__ = ["DataConfig", "read_rows", "require_fields", "chat_prompt_ids", "encode_sft", "sample_indices",
           "micro_batches", "collate_sft", "addition_rows", "multiplication_rows", "guess_rows", "careless", "IGNORE"]

IGNORE = -100   # label of a token that is not trained on (prompt, padding)


@dataclass
class DataConfig:
    path: str = "artifacts/tiny/data/train.jsonl"   # .jsonl / .json / .parquet file, or a `datasets` name
    split: str = "train"                             # for a `datasets` name
    subset: str | None = None                        # for a `datasets` name with configs (gsm8k: "main")
    prompt_field: str = "prompt"
    response_field: str = "response"
    eval_path: str | None = "artifacts/tiny/data/eval.jsonl"   # held-out rows; None: hold out eval_rows
    eval_split: str = "test"                         # for a `datasets` name
    eval_rows: PositiveInt = 200                     # held-out rows evaluated (taken from the end if no eval_path)
    max_length: PositiveInt = 256                    # longer examples are truncated (and counted)
    pack: bool = False                               # pack a micro-batch's examples into fewer rows


def read_rows(source: str, split: str = "train", subset: str | None = None) -> list[dict]:
    """A .jsonl/.json/.parquet file; or a `datasets` name / local data set directory (with split, subset)."""
    path = Path(source)
    if path.is_file() or path.suffix in (".jsonl", ".json", ".parquet"):
        if not path.is_file():
            raise ForgeError(f"data error: {source}: no such file")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path).to_pylist()
        return _read_jsonl(path)
    import datasets
    try:
        return list(datasets.load_dataset(source, subset, split=split))
    except Exception as err:   # datasets raises many types; all mean "cannot get this data set"
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise ForgeError(f"data error: '{source}' (split '{split}') is neither a local file nor a loadable "
                         f"data set ({type(err).__name__}: {first_line})") from None


def _read_jsonl(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ForgeError(f"data error: {path} line {line_no}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ForgeError(f"data error: {path} line {line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ForgeError(f"data error: {path}: no rows")
    return rows


def require_fields(rows: list[dict], fields: list[str], source: str) -> None:
    """Every row must carry every field; the error names the first bad row (1-based, = JSONL line)."""
    for i, row in enumerate(rows, start=1):
        for name in fields:
            if row.get(name) is None:
                raise ForgeError(f"data error: {source} row {i}: no '{name}' field (has: {', '.join(row)})")


def chat_prompt_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """The user turn (or a whole conversation of {"role", "content"} messages) plus the assistant header,
    exactly what the model sees before it answers."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def encode_sft(tokenizer, prompt: str, response: str, max_length: int) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, truncated): labels are IGNORE on the prompt, the response + EOS are trained."""
    prompt_ids = chat_prompt_ids(tokenizer, prompt)
    response_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + response_ids)[:max_length]
    return ids, labels, len(prompt_ids) + len(response_ids) > max_length


def sample_indices(step: int, batch_size: int, num_rows: int, seed: int) -> list[int]:
    """Rows of global batch `step`: a fresh permutation per epoch, concatenated; a pure function of step."""
    start, out = step * batch_size, []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out.extend(perm[offset:offset + batch_size - len(out)])
    return out


def micro_batches(lengths: list[int], ranks: int, per_rank: int, pack: bool) -> list[list[list[int]]]:
    """A global batch's examples (their token counts) dealt as `per_rank` micro-batches of indices to each of
    `ranks` ranks, so that the slowest rank computes the fewest padded tokens. Padded rows: sorted by length and
    cut into runs whose largest cost (rows x longest row) is as small as it can be, so that a run of short
    examples takes more of them than one of long ones. Packed: each example, longest first, to the micro-batch
    with the fewest tokens. Then the costliest micro-batch goes to the rank with the least work so far. The loss
    is normalised by the global batch's targets, so how examples are dealt changes only the order of a sum."""
    count, order = ranks * per_rank, sorted(range(len(lengths)), key=lambda i: -lengths[i])

    def cost(batch: list[int]) -> int:
        return sum(lengths[i] for i in batch) if pack else len(batch) * max(lengths[i] for i in batch)

    if pack:
        batches: list[list[int]] = [[] for _ in range(count)]
        for i in order:
            min(batches, key=cost).append(i)
    else:
        batches = [order[run.start:run.stop] for run in _cheapest_runs([lengths[i] for i in order], count)]
    dealt: list[list[list[int]]] = [[] for _ in range(ranks)]
    for batch in sorted(batches, key=cost, reverse=True):
        rank = min((r for r in range(ranks) if len(dealt[r]) < per_rank), key=lambda r: sum(map(cost, dealt[r])))
        dealt[rank].append(batch)
    return dealt


def _cheapest_runs(sizes: list[int], count: int) -> list[range]:
    """`count` consecutive runs of `sizes` (descending, at least `count` of them) whose largest cost, rows x the
    run's first size, is smallest: a binary search on that cost, each candidate cut greedily; then runs split in
    two until there are `count` (a split costs nothing)."""
    def greedy(cap: int) -> list[range]:
        runs, start = [], 0
        while start < len(sizes):
            end = start + max(1, cap // sizes[start])
            runs.append(range(start, min(end, len(sizes))))
            start = runs[-1].stop
        return runs

    low, high = sizes[0], len(sizes) * sizes[0]
    while low < high:
        cap = (low + high) // 2
        low, high = (low, cap) if len(greedy(cap)) <= count else (cap + 1, high)
    runs = greedy(low)
    while len(runs) < count:
        i = max((i for i, run in enumerate(runs) if len(run) > 1), key=lambda i: len(runs[i]) * sizes[runs[i].start])
        middle = runs[i].start + len(runs[i]) // 2
        runs[i:i + 1] = [range(runs[i].start, middle), range(middle, runs[i].stop)]
    return runs


def collate_sft(examples: list[tuple[list[int], list[int]]], pad_id: int, pack: bool,
                max_length: int) -> dict[str, torch.Tensor]:
    """Right-pad into [N, S] tensors; with `pack`, first-fit the examples into rows of max_length and
    restart position_ids per example (transformers then masks attention between packed examples)."""
    rows = _first_fit(examples, max_length) if pack else [[ex] for ex in examples]
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for ids, labs in row:
            n = len(ids)
            input_ids[r, col:col + n] = torch.tensor(ids)
            labels[r, col:col + n] = torch.tensor(labs)
            position_ids[r, col:col + n] = torch.arange(n)
            attention_mask[r, col:col + n] = 1
            col += n
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if not pack:    # packed rows must go without attention_mask: it is what enables packed-sequence masking
        batch["attention_mask"] = attention_mask
    return batch


def _first_fit(examples: list[tuple[list[int], list[int]]], max_length: int) -> list[list]:
    rows: list[list] = []
    lengths: list[int] = []
    for ex in examples:
        for r, used in enumerate(lengths):
            if used + len(ex[0]) <= max_length:
                rows[r].append(ex)
                lengths[r] += len(ex[0])
                break
        else:
            rows.append([ex])
            lengths.append(len(ex[0]))
    return rows


# ---- the synthetic verifiable task ----

def addition_rows(num_rows: int, seed: int, digits: int = 3, exclude: set[str] = frozenset(),
                  label_noise: float = 0.0) -> list[dict]:
    """`12+45=` -> `57`: distinct problems, none of them in `exclude` (keeps eval held out). With `label_noise`,
    that share of the responses (what SFT imitates) has its last digit one too high (`57` -> `58`, `59` -> `50`),
    a careless teacher's slip; `answer` (what rewards check) is always the true sum."""
    rng = random.Random(seed)
    rows = []
    for a, b, prompt in _distinct_problems(num_rows, rng, 0, 10 ** digits, "+", exclude):
        answer = str(a + b)
        response = careless(answer) if rng.random() < label_noise else answer
        rows.append({"prompt": prompt, "response": response, "answer": answer})
    return rows


def careless(answer: str) -> str:
    """The careless teacher's slip: the last digit one too high (`57` -> `58`, `59` -> `50`)."""
    return answer[:-1] + str((int(answer[-1]) + 1) % 10)


def multiplication_rows(num_rows: int, seed: int, exclude: set[str] = frozenset(), tool_share: float = 0.0
                        ) -> list[dict]:
    """`37*48=` -> `1776` (two-digit operands), the calculator environment's task. Of the responses SFT imitates,
    `tool_share` are calculator traces (`<calc>37*48</calc><result>1776</result>1776`), the rest bare answers."""
    rng = random.Random(seed)
    rows = []
    for a, b, prompt in _distinct_problems(num_rows, rng, 10, 100, "*", exclude):
        answer = str(a * b)
        trace = f"<calc>{a}*{b}</calc><result>{answer}</result>{answer}"
        rows.append({"prompt": prompt, "response": trace if rng.random() < tool_share else answer, "answer": answer})
    return rows


def guess_rows(num_games: int, seed: int, high: int = 16) -> list[dict]:
    """The number-guessing game (environments.py:GuessNumber): `answer` is the secret in [1, high]. Each game is
    also played by a random but consistent guesser (each guess uniform among the numbers the replies so far
    allow), one SFT row per guess: `prompt` the conversation so far, `response` the next guess."""
    rng = random.Random(seed)
    question = f"Guess my number between 1 and {high}."
    rows = []
    for _ in range(num_games):
        secret, low, top = rng.randint(1, high), 1, high
        talk = [{"role": "user", "content": question}]
        while True:
            guess = rng.randint(low, top)
            rows.append({"prompt": list(talk), "response": str(guess), "answer": str(secret)})
            if guess == secret:
                break
            reply = "higher" if guess < secret else "lower"
            low, top = (guess + 1, top) if reply == "higher" else (low, guess - 1)
            talk += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": reply}]
    return rows


def _distinct_problems(num_rows: int, rng: random.Random, low: int, high: int, op: str, exclude: set[str]):
    """(a, b, "a<op>b=") for distinct operand pairs in [low, high), none of whose prompts is in `exclude`."""
    if num_rows > (high - low) ** 2 - len(exclude):
        raise ForgeError(f"data error: only {(high - low) ** 2} distinct problems with operands in [{low}, {high})")
    seen = set(exclude)
    while len(seen) - len(exclude) < num_rows:
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        prompt = f"{a}{op}{b}="
        if prompt not in seen:
            seen.add(prompt)
            yield a, b, prompt
