"""Rows in (JSONL / Parquet / a `datasets` name), token ids out: chat template, response-only labels (or every
assistant turn of a conversation), optional packing, and a step-indexed sample stream that makes resuming exact
(position = step). A bad row is a one-line data error naming its file and row; a prompt too long for what must
follow it is dropped and counted.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import PositiveInt

from .config import ForgeError

__all__ = ["DataConfig", "read_rows", "require_fields", "require_text", "chat_prompt_ids", "drop_long_prompts",
           "fitting_prompts", "encode_sft", "label_assistant_turns", "sample_indices", "micro_batches", "collate_sft",
           "prompt_rows", "IGNORE"]

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
    max_length: PositiveInt = 256                    # longer examples are truncated (and counted); a row whose
                                                     # prompt alone fills it is skipped (and counted)
    pack: bool = False                               # pack a micro-batch's examples into fewer rows
    every_assistant_turn: bool = False               # SFT: also train the assistant turns of a chat prompt (one
                                                     # row per conversation, not per turn; TRL's assistant_only_loss)


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
    data = path.read_bytes()
    if path.suffix == ".json" and data.lstrip().startswith(b"["):
        rows = [_require_object(row, f"{path} row {i}") for i, row in enumerate(_parse(path, data, 1), start=1)]
    else:
        rows = []
        for line_no, line in enumerate(data.splitlines(), start=1):
            if line.strip():
                rows.append(_require_object(_parse(path, line, line_no), f"{path} line {line_no}"))
    if not rows:
        raise ForgeError(f"data error: {path}: no rows")
    return rows


def _parse(path: Path, data: bytes, first_line: int):
    """JSON text that starts on line `first_line` of `path`; the error names the line where it goes wrong."""
    try:
        text = data.decode()
    except UnicodeDecodeError as err:
        line_no = first_line + data.count(b"\n", 0, err.start)
        raise ForgeError(f"data error: {path} line {line_no}: not valid UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ForgeError(f"data error: {path} line {first_line + err.lineno - 1}: not valid JSON ({err.msg})") from None


def _require_object(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ForgeError(f"data error: {where}: expected a JSON object, got {type(row).__name__}")
    return row


def require_fields(rows: list[dict], fields: list[str], source: str) -> None:
    """Every row must carry every field, not null; the error names the first bad row (1-based, = JSONL line)."""
    for i, row in enumerate(rows, start=1):
        for name in fields:
            if name not in row:
                raise ForgeError(f"data error: {source} row {i}: no '{name}' field (has: {', '.join(row)})")
            if row[name] is None:
                raise ForgeError(f"data error: {source} row {i}: '{name}' is null")


_MESSAGE = '{"role": string, "content": string}'


def require_text(rows: list[dict], field: str, source: str, messages: bool = False) -> None:
    """Every row's `field` is a string, or with `messages` also a list of {"role", "content"} messages (what
    `chat_prompt_ids` takes); the error names the first row that holds anything else (a number, an object...)."""
    expected = f"a string or a list of {_MESSAGE} messages" if messages else "a string"
    for i, row in enumerate(rows, start=1):
        value = row[field]
        if isinstance(value, str):
            continue
        if not (messages and isinstance(value, list) and value):
            raise ForgeError(f"data error: {source} row {i}: '{field}' is {_shown(value)} ({_kind(value)}): "
                             f"expected {expected}")
        for k, message in enumerate(value, start=1):
            if not (isinstance(message, dict) and set(message) >= {"role", "content"}
                    and all(isinstance(message[key], str) for key in ("role", "content"))):
                raise ForgeError(f"data error: {source} row {i}: '{field}' message {k} is {_shown(message)}: "
                                 f"expected {_MESSAGE}")


def _shown(value) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)     # Parquet rows may hold numpy values, dates
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


def chat_prompt_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """The user turn (or a whole conversation of {"role", "content"} messages) plus the assistant header,
    exactly what the model sees before it answers."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def drop_long_prompts(rows: list[dict], prompt_ids: list[list[int]], limit: int, source: str, why: str,
                      warn: Callable[[str], None]) -> tuple[list[dict], list[list[int]]]:
    """The rows (and their prompts' token ids) whose prompt has at most `limit` tokens, in order; `warn` gets a
    line that counts the others and names the first, if any; when none is kept, a data error. `why` says what
    sets the limit."""
    kept = [i for i, ids in enumerate(prompt_ids) if len(ids) <= limit]
    if not kept:
        raise ForgeError(f"data error: {source}: every prompt is longer than {limit} tokens ({why}); the shortest "
                         f"has {min(map(len, prompt_ids))}")
    if len(kept) == len(rows):
        return rows, prompt_ids
    first = next(i for i, ids in enumerate(prompt_ids) if len(ids) > limit)
    warn(f"data warning: {source}: skipped {len(rows) - len(kept)} of {len(rows)} rows whose prompt is longer than "
         f"{limit} tokens ({why}); the first is row {first + 1} ({len(prompt_ids[first])} tokens)")
    return [rows[i] for i in kept], [prompt_ids[i] for i in kept]


def fitting_prompts(rows: list[dict], tokenizer, field: str, limit: int, source: str, why: str,
                    warn: Callable[[str], None]) -> tuple[list[dict], list[list[int]]]:
    """`drop_long_prompts` of the rows' `field` prompts, as `chat_prompt_ids` formats them."""
    return drop_long_prompts(rows, [chat_prompt_ids(tokenizer, r[field]) for r in rows], limit, source, why, warn)


def prompt_rows(source: str, split: str, subset: str | None, fields: list[str], tokenizer, limit: int | None,
                why: str, warn: Callable[[str], None], count: int | None = None) -> list[dict]:
    """The first `count` rows of a data set, each with `fields` and a prompt (the first field) of text or chat
    messages; with a `limit`, only those whose formatted prompt has at most `limit` tokens (`fitting_prompts`)."""
    rows = read_rows(source, split, subset)[:count]
    require_fields(rows, fields, source)
    require_text(rows, fields[0], source, messages=True)
    return rows if limit is None else fitting_prompts(rows, tokenizer, fields[0], limit, source, why, warn)[0]


def encode_sft(tokenizer, prompt_ids: list[int], response: str, max_length: int, end_id: int
               ) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, truncated) of a prompt (`chat_prompt_ids`) and its response: labels are IGNORE on the
    prompt, the response and `end_id` (the template's end of turn, `model.turn_end`: the token at which the
    engine will stop the model's turn) are trained."""
    response_ids = tokenizer(response, add_special_tokens=False).input_ids + [end_id]
    ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE] * len(prompt_ids) + response_ids)[:max_length]
    return ids, labels, len(prompt_ids) + len(response_ids) > max_length


def label_assistant_turns(tokenizer, prompt: str | list[dict[str, str]], ids: list[int], labels: list[int],
                          end_id: int) -> str | None:
    """Label each assistant message of a chat prompt in `labels` (in place), with its end of turn, where the
    template put it in `ids` (`encode_sft`'s). None, or what is wrong: a template that rewrites earlier turns
    (Qwen3 drops their reasoning) does not hold them as the model generated them, so they cannot be trained so."""
    for i, message in enumerate(prompt if isinstance(prompt, list) else []):
        if message["role"] != "assistant":
            continue
        start = len(chat_prompt_ids(tokenizer, prompt[:i]))
        turn = tokenizer(message["content"], add_special_tokens=False).input_ids + [end_id]
        turn = turn[:max(0, len(ids) - start)]                  # data.max_length may cut the conversation
        if ids[start:start + len(turn)] != turn:
            return f"message {i + 1} (assistant) is not where the chat template puts the conversation's turns"
        labels[start:start + len(turn)] = turn
    return None


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
                max_length: int, with_real: bool = False) -> dict[str, torch.Tensor]:
    """Right-pad into [N, S] tensors; with `pack`, first-fit the examples into rows of max_length and
    restart position_ids per example (transformers then masks attention between packed examples). `with_real`:
    also "real_tokens", the bool mask of what is not padding (packed rows have no attention mask to say it)."""
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
    if with_real:
        batch["real_tokens"] = attention_mask.bool()
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
