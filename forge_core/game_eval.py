"""Held-out play: scores against each opponent (greedy, the policy in every seat in turn), the exploitability
of the policy read out of the engine for games that report it, and a run's before -> after lines.
"""

import math

import torch
import torch.distributed as dist

from .data import chat_prompt_ids
from .dist import set_phase
from .env import EnvConfig, observation_ids
from .metrics import reduce_metrics
from .model import turn_end

__all__ = ["evaluate_games", "exploitability_metrics", "move_probabilities", "move_prompts", "describe_games"]


def evaluate_games(sample, num_games: int, opponents: list[str], players: int, me: int,
                   group: dist.ProcessGroup) -> dict:
    """Held-out play, greedy: `num_games` games against each opponent, the policy in seat i % players of game i,
    each policy rank a share. Score = wins + half the draws; per seat too; illegal moves of the policy's moves.
    `eval/accuracy` is the score against the first opponent."""
    set_phase("eval")
    index = list(range(me, num_games, dist.get_world_size(group)))
    out, illegal, moves = {}, 0.0, 0.0
    for opponent in opponents:
        e = sample(index, seed=0, greedy=True, against=opponent).episode
        score = e["win"] + 0.5 * e["draw"]
        seats = {f"score_seat{s}": score[e["seat"] == s].sum().item() for s in range(players)}
        sums = reduce_metrics({"n": len(score), "score": score.sum().item(), "score2": (score ** 2).sum().item(),
                               **{k: e[k].sum().item() for k in ("return", "win", "draw", "loss", "moves")},
                               "illegal": e["illegal"].sum().item(), "turns": e["turns"].sum().item(),
                               **seats, **{f"n_seat{s}": (e["seat"] == s).sum().item() for s in range(len(seats))}},
                              group)
        n = sums["n"]
        out |= {f"eval/{k}_vs_{opponent}": sums[k] / n for k in ("score", "return", "win", "draw", "loss", "moves")}
        out |= {f"eval/score_vs_{opponent}_seat{s}": sums[f"score_seat{s}"] / max(sums[f"n_seat{s}"], 1)
                for s in range(len(seats))}
        out[f"eval/score_se_vs_{opponent}"] = math.sqrt(max(sums["score2"] / n - (sums["score"] / n) ** 2, 0) / n)
        out["eval/games"] = n
        illegal, moves = illegal + sums["illegal"], moves + sums["turns"]
    out["eval/illegal_rate"] = illegal / max(moves, 1.0)
    out["eval/accuracy"] = out[f"eval/score_vs_{opponents[0]}"]
    return out


def exploitability_metrics(engine, tokenizer, game, env_cfg: EnvConfig) -> dict[str, float]:
    """`eval/exploitability` of the engine's moves (T=1) for a game that reports it (`exploitability(policy)`,
    environments.py:OpenSpielGame), else nothing."""
    report = getattr(game, "exploitability", None)
    value = report(lambda chats: move_probabilities(engine, tokenizer, chats, env_cfg)) if report else None
    return {} if value is None else {"eval/exploitability": value}


def move_probabilities(engine, tokenizer, chats: list[tuple[list[str], list[str], list[str]]],
                       env_cfg: EnvConfig) -> list[list[float]]:
    """For each chat (a seat's views, its moves between them, its legal moves now), the engine's probability of
    writing each legal move and ending its turn, renormalized over the legal moves (its prompt logprobs)."""
    from vllm import SamplingParams
    prompts, sizes = move_prompts(tokenizer, chats, env_cfg)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids, _ in prompts],
                              SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    scores = torch.tensor([sum(step[token].logprob for step, token in zip(out.prompt_logprobs[-n:], ids[-n:]))
                           for out, (ids, n) in zip(outputs, prompts)], dtype=torch.float64)
    return [part.softmax(0).tolist() for part in scores.split(sizes)]


def move_prompts(tokenizer, chats, env_cfg: EnvConfig) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Each chat's context laid out as a game's trajectory is, followed by each legal move and the end of turn:
    (ids, the move's token count with its end), and the count of legal moves per chat."""
    end = turn_end(tokenizer)
    prompts, sizes = [], []
    for views, moves, legal in chats:
        context = chat_prompt_ids(tokenizer, views[0])
        for move, view in zip(moves, views[1:]):
            context += tokenizer(move, add_special_tokens=False).input_ids + [end.ids[0]]
            context += observation_ids(tokenizer, view, "end", "user", env_cfg.max_observation_tokens, end.text)
        for move in legal:
            written = tokenizer(move, add_special_tokens=False).input_ids + [end.ids[0]]
            prompts.append((context + written, len(written)))
        sizes.append(len(legal))
    return prompts, sizes


def describe_games(start: dict, end: dict, opponents: list[str]) -> str:
    """The run's held-out figures, before and after: score against each opponent, illegal moves."""
    def se(o: str) -> float:
        return max(start[f"eval/score_se_vs_{o}"], end[f"eval/score_se_vs_{o}"])
    lines = [f"score vs {o}: {start[f'eval/score_vs_{o}']:.3f} -> {end[f'eval/score_vs_{o}']:.3f} "
             f"({int(end['eval/games'])} games, s.e. {se(o):.3f})"
             f"; mean return {start[f'eval/return_vs_{o}']:.3f} -> {end[f'eval/return_vs_{o}']:.3f}" for o in opponents]
    if "eval/exploitability" in end:
        lines.append(f"exploitability: {start['eval/exploitability']:.3f} -> {end['eval/exploitability']:.3f} "
                     "(OpenSpiel's, of the model's move probabilities at T=1)")
    return "\n".join(lines + [f"illegal moves: {start['eval/illegal_rate']:.3f} -> {end['eval/illegal_rate']:.3f} of "
                              "moves (held-out, greedy)"])
