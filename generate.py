"""Chat with, or batch-generate from, any exported checkpoint (an HF safetensors directory) with vLLM.

    python generate.py --model.path runs/grpo-tiny/hf                       # interactive chat
    python generate.py --model.path runs/grpo-tiny/hf --prompts artifacts/tiny/data/eval.jsonl \
        --output samples.jsonl --sampling.num_generations 4 --sampling.temperature 0.7
    torchrun --standalone --nproc_per_node 2 generate.py --prompts ...     # an engine a rank, each half the rows
    torchrun --standalone --nproc_per_node 2 generate.py --engine.tensor_parallel_size 2 ...   # TP (GPUs)

Chat commands: /reset starts a new conversation, /exit (or Ctrl-D) leaves.
"""

import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")    # the chat and the printed JSONL stay readable
if __name__ == "__main__":
    gc.disable()        # while the imports build what lives as long as the process (dist.freeze_startup_objects)

from forge_core.config import ForgeError, load_config
from forge_core.data import chat_prompt_ids, drop_long_prompts, read_rows, require_fields, require_text
from forge_core.dist import Dist, close_dist, exchange, init_dist, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine, check_tensor_parallel, context_length
from forge_core.model import ModelConfig, load_tokenizer, turn_end


@dataclass
class GenerateConfig:
    """Generate with vLLM from an HF checkpoint (forge-spmd)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="runs/grpo-tiny/hf"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(num_generations=1, max_tokens=256,
                                                                            temperature=0.7))
    prompts: str | None = None          # .jsonl / .json / .parquet file or a `datasets` name: batch mode; None: chat
    split: str = "test"                 # for a `datasets` name
    subset: str | None = None
    prompt_field: str = "prompt"
    limit: int | None = None            # first N rows only
    output: str | None = None           # batch results as JSONL (row + "completions"); None: print them
    system: str | None = None           # system message put before every conversation
    seed: int = 0


def sampling_params(cfg: SamplingConfig, seed: int, stop_ids: tuple[int, ...]):
    from vllm import SamplingParams   # temperature 0 is greedy
    return SamplingParams(n=cfg.num_generations, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, stop_token_ids=list(stop_ids))


def complete(engine, tokenizer, prompts: list[list[int]], cfg: GenerateConfig) -> list[list[str]]:
    """num_generations completions (text) for each prompt (token ids, `chat_prompt_ids`)."""
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    outputs = engine.generate(requests, sampling_params(cfg.sampling, cfg.seed, turn_end(tokenizer).ids),
                              use_tqdm=False)
    return [[tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in out.outputs] for out in outputs]


def opening(cfg: GenerateConfig) -> list[dict]:
    return [{"role": "system", "content": cfg.system}] if cfg.system else []


def batch_prompts(cfg: GenerateConfig, tokenizer, warn: Callable[[str], None]) -> tuple[list[dict], list[list[int]]]:
    """The rows to complete and their prompts' token ids (a string prompt is the user's message, a list of
    messages the conversation; the system message first), checked before the engine starts: a row whose prompt
    leaves the engine no room for an answer is left out, and `warn` hears which."""
    rows = read_rows(cfg.prompts, cfg.split, cfg.subset)[:cfg.limit]
    require_fields(rows, [cfg.prompt_field], cfg.prompts)
    require_text(rows, cfg.prompt_field, cfg.prompts, messages=True)
    prompts = [row[cfg.prompt_field] for row in rows]
    conversations = [opening(cfg) + ([{"role": "user", "content": p}] if isinstance(p, str) else p) for p in prompts]
    context = context_length(cfg.engine, cfg.model)
    return drop_long_prompts(rows, [chat_prompt_ids(tokenizer, c) for c in conversations], context - 1, cfg.prompts,
                             f"the engine's {context}-token context leaves no room for an answer", warn)


def batch(engine, tokenizer, rows: list[dict], prompts: list[list[int]], cfg: GenerateConfig, d: Dist) -> None:
    """Each engine completes every n-th row (n engines); rank 0 writes them all, in the file's order."""
    engines = d.world_size // cfg.engine.tensor_parallel_size
    mine = range(d.rank // cfg.engine.tensor_parallel_size, len(rows), engines)
    completions = dict(zip(mine, complete(engine, tokenizer, [prompts[i] for i in mine], cfg) if mine else []))
    completions = {i: texts for share in exchange(completions) for i, texts in share.items()}
    if not d.is_rank0:
        return
    lines = "".join(json.dumps({**row, "completions": completions[i]}) + "\n" for i, row in enumerate(rows))
    if cfg.output:
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(lines)
        print(f"wrote {len(rows)} rows to {cfg.output} ({engines} engine{'s' if engines > 1 else ''})")
    else:
        sys.stdout.write(lines)


def chat(engine, tokenizer, cfg: GenerateConfig, is_rank0: bool) -> None:
    """A read-eval-print loop; rank 0 reads, every engine rank generates (TP engines are collective). A message
    that would make the conversation longer than the engine holds is left out, with a note."""
    messages, context = opening(cfg), context_length(cfg.engine, cfg.model)
    while True:
        line = exchange(_read_line() if is_rank0 else None)[0]
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = opening(cfg)
            continue
        prompt = chat_prompt_ids(tokenizer, messages + [{"role": "user", "content": line}])
        if len(prompt) >= context:      # vLLM refuses it: no room for a single token of the answer
            if is_rank0:
                print(f"message left out: the conversation would be {len(prompt)} tokens and the engine holds "
                      f"{context} (/reset starts a new one)", file=sys.stderr, flush=True)
            continue
        reply = complete(engine, tokenizer, [prompt], cfg)[0][0]
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
        if is_rank0:
            print(reply, flush=True)


def _read_line() -> str | None:
    try:
        return input(">>> " if sys.stdin.isatty() else "")
    except EOFError:
        return None


def main() -> None:
    cfg = load_config(GenerateConfig)
    d = init_dist()
    if d.world_size % cfg.engine.tensor_parallel_size:
        raise ForgeError(f"config error: {d.world_size} ranks are not a multiple of "
                         f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size}")
    tokenizer = load_tokenizer(cfg.model)
    check_tensor_parallel(cfg.engine, cfg.model)
    if cfg.prompts is not None:         # bad rows fail before the engine starts
        rows, prompts = batch_prompts(cfg, tokenizer, lambda line: print(line, file=sys.stderr) if d.is_rank0 else None)
    engine = build_engine(cfg.model.path, cfg.engine, cfg.seed)
    if cfg.prompts is not None:
        batch(engine, tokenizer, rows, prompts, cfg, d)
    else:
        chat(engine, tokenizer, cfg, d.is_rank0)
    close_dist()


if __name__ == "__main__":
    run_main(main)
