"""Multi-agent episodes: games whose seats the policy, a frozen snapshot of it, or scripted players take.

A game is an environment (forge_core/env.py) that declares `players`; one instance per game (a protocol:
nothing to subclass; environments.py:OpenSpielGame wraps any OpenSpiel game):

    class Game:
        players = 2
        bots = ("random",)                      # optional: the scripted players it has
        def reset(self, row: dict) -> None      # a data row (its "seed": chance outcomes) -> a new game
        def current_player(self) -> int         # the seat to move, or -1 once the game is over
        def observation(self, seat: int) -> str # what that seat sees when it is to move (its next user message)
        def step(self, action: str) -> str | None   # the mover's move: None once played, else why it is illegal
        def returns(self) -> list[float]        # one per seat, once the game is over
        def bot_move(self, name: str) -> str    # scripted player `name`'s move for the seat to move

Every seat an engine plays is a trajectory of its own: its first view is its prompt, its moves are its tokens
(the engine's ids and logprobs, model_mask 1), the views at its later turns are observation tokens (mask 0), so
the opponent's moves reach it only as context, and its return is its reward alone. An illegal move (`step`
says why) is retried with the reason as the seat's next message, up to `game.retries` times, or loses: the
mover gets `game.illegal_reward`, the others 0. Either way it is counted (`episode/illegal`).

Who plays (`game.opponents`: a share of each step's rows against each, in config order): `self` (the policy in
every seat, every seat trained, each seat's G games of a row a GRPO group of their own), `frozen` (the start
model, or the policy of every `frozen_refresh_every` steps: a second engine on the policy ranks, which the
trainer never updates; with `pool_size` N each row draws one of the last N snapshots, forge_core/snapshots.py),
or one of the game's `bots` (OpenSpiel's random and MCTS players). Against an opponent the policy plays one
seat, the row's `(row id + step) % players`, and only that seat trains. Held-out play: forge_core/game_eval.py.

Advantages (`game.advantage`): `grpo`, each (row, seat) group's returns against their mean and std; or `rae`,
SPIRAL's role-conditioned advantage estimation, the return less an EMA of the returns of its (opponent, seat),
whose baselines a checkpoint keeps.
"""

import math
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.distributed as dist
from pydantic import NonNegativeInt, PositiveInt
from torch import Tensor

from .config import ForgeError
from .data import chat_prompt_ids
from .engine import SamplingConfig, max_model_len, sampling_params, seeded_draws
from .env import (EnvConfig, Episode, bounded_calls, env_error, observation_ids, subreaping, take_turn, to_rollout,
                  turn_room)
from .model import turn_end
from .processes import descendants
from .rollout import Rollout, cat_rollouts
from .sessions import Sessions
from .snapshots import SnapshotPool

__all__ = ["GameConfig", "is_game", "check_game", "opponents_of", "deal", "game_sampler", "play_games", "RAE",
           "game_outcomes"]

ENGINE_PLAYERS = ("policy", "frozen")


@dataclass
class GameConfig:
    opponents: dict[str, float] = field(default_factory=lambda: {"self": 1.0})  # share of a step's rows per opponent
    illegal: Literal["lose", "retry"] = "lose"
    retries: NonNegativeInt = 2         # illegal moves a seat may retry in a row ("retry"); then it loses
    illegal_reward: float = -1.0        # the return of a seat that lost by an illegal move (the others get 0)
    illegal_cost: float = 0.0           # "retry": taken from the mover's return for each illegal move it retried
    frozen_refresh_every: NonNegativeInt = 0   # steps between snapshots of the policy for `frozen`; 0 = the start model
    pool_size: PositiveInt = 1          # `frozen` rows draw one of the last N snapshots (fictitious self-play)
    advantage: Literal["grpo", "rae"] = "grpo"
    rae_decay: float = 0.95             # RAE's EMA: baseline <- decay * baseline + (1 - decay) * mean return
    eval_opponents: list[str] = field(default_factory=lambda: ["random"])   # held-out play (data.eval_rows games
                                        # against each, greedy, the policy in each seat half of them)


def is_game(env_class, env_cfg: EnvConfig) -> bool:
    """The environment has `players` (an instance: a generic game's count depends on its arguments)."""
    return env_class is not None and hasattr(env_class(**env_cfg.args), "players")


def opponents_of(cfg: GameConfig) -> list[str]:
    """Every opponent a run plays (training and held-out), in a fixed order: their index is logged per episode."""
    return list(dict.fromkeys([*cfg.opponents, *cfg.eval_opponents]))


def check_game(env_class, env_cfg: EnvConfig, cfg: GameConfig, row: dict, rows_per_rank: int, G: int,
               mini_batches: int, tensor_parallel_size: int) -> None:
    """Everything about a game's config that fails before any work, one line each. Builds and resets one game on
    `row` and asks whose turn it is."""
    if tensor_parallel_size > 1:
        raise ForgeError("config error: games play on engines of one rank (engine.tensor_parallel_size 1), "
                         f"not {tensor_parallel_size}")
    if env_cfg.schedule != "turns":
        raise ForgeError(f"config error: env.schedule={env_cfg.schedule} is for environments: a game's seats play "
                         "in rounds (env.schedule turns)")
    game = env_class(**env_cfg.args)
    players, bots = game.players, tuple(getattr(game, "bots", ()))
    known = ("self", "frozen", *bots)
    for name in opponents_of(cfg):
        if name not in known:
            raise ForgeError(f"config error: game opponent '{name}' is none of {list(known)} "
                             f"({type(game).__name__}'s bots: {list(bots)})")
    if cfg.pool_size > 1 and not cfg.frozen_refresh_every:
        raise ForgeError(f"config error: game.pool_size={cfg.pool_size} needs game.frozen_refresh_every > 0 "
                         "(without refreshes the pool holds the start model alone)")
    if "self" in cfg.eval_opponents:
        raise ForgeError("config error: game.eval_opponents: 'self' has no score (both seats are the policy)")
    if abs(sum(cfg.opponents.values()) - 1) > 1e-6 or min(cfg.opponents.values()) < 0:
        raise ForgeError(f"config error: game.opponents shares {cfg.opponents} must be >= 0 and add up to 1")
    for name, share in cfg.opponents.items():
        if abs(share * rows_per_rank - round(share * rows_per_rank)) > 1e-6:
            raise ForgeError(f"config error: game.opponents: {name}'s share {share} of the {rows_per_rank} rows "
                             "per policy rank (train.prompts_per_step / layout.policy) is not a whole number of rows")
    game.reset(row)
    seat = game.current_player()
    if not isinstance(players, int) or players < 1 or not isinstance(seat, int) or not 0 <= seat < players:
        raise ForgeError(f"env error: {type(game).__name__} has players={players!r} but says seat {seat!r} "
                         "moves first: players and turns disagree")
    trajectories = G * sum(round(share * rows_per_rank) * (players if name == "self" else 1)
                           for name, share in cfg.opponents.items())
    if trajectories % mini_batches:
        raise ForgeError(f"config error: {trajectories} trajectories per policy rank do not split into "
                         f"train.mini_batches={mini_batches}")


def deal(cfg: GameConfig, row_ids: list[int], step_seed: int, players: int) -> tuple[list[str], list[int]]:
    """Each row's opponent (a share of the rows each, in config order) and the seat the policy plays against it."""
    counts = [round(share * len(row_ids)) for share in cfg.opponents.values()]
    opponents = [name for name, n in zip(cfg.opponents, counts) for _ in range(n)]
    return opponents, [(r + step_seed) % players for r in row_ids]


def game_sampler(engines: dict, tokenizer, game_class, rows: list[dict], sampling: SamplingConfig, env_cfg: EnvConfig,
                 cfg: GameConfig, pool: SnapshotPool | None = None) -> Callable[..., Rollout]:
    """`sample(row indices, seed, greedy, against=None)` -> Rollout: G games per row against the opponents `deal`
    gives the rows, or all against `against`, the policy in seat i % players of row i. A `frozen` row plays the
    pool's snapshot it draws: the rows of each snapshot any rank drew are played after it is loaded (the first
    with the other rows); held-out games play the newest."""
    players = game_class(**env_cfg.args).players

    def play(index: list[int], opponents: list[str], seats: list[int], seed: int, greedy: bool) -> Rollout:
        return play_games(engines, tokenizer, game_class, [rows[i] for i in index], index, opponents, seats,
                          sampling, env_cfg, cfg, seed, greedy)

    def sample(index: list[int], seed: int, greedy: bool = False, against: str | None = None) -> Rollout:
        if against is not None:
            if against == "frozen":
                pool.load(-1)
            return play(index, [against] * len(index), [i % players for i in index], seed, greedy)
        opponents, seats = deal(cfg, index, seed, players)
        if pool is None:
            return play(index, opponents, seats, seed, greedy)
        drawn = [pool.draw(seed, r) if o == "frozen" else None for o, r in zip(opponents, index)]
        parts = []
        for k, snapshot in enumerate(pool.drawn_anywhere([d for d in drawn if d is not None]) or [None]):
            if snapshot is not None:
                pool.load(snapshot)
            mine = [i for i, d in enumerate(drawn) if d == snapshot or (k == 0 and d is None)]
            if mine:
                parts.append(play([index[i] for i in mine], [opponents[i] for i in mine], [seats[i] for i in mine],
                                  seed + 10_000_019 * k, greedy))
        rollout = cat_rollouts(parts)
        rollout.seconds = {name: sum(p.seconds[name] for p in parts) for name in parts[0].seconds}
        return rollout
    return sample


@dataclass
class _Game:
    env: object
    row: dict
    row_id: int
    opponent: int                               # its index in `opponents_of(cfg)`
    players: list[str]                          # per seat: "policy", "frozen" or a bot's name
    seats: dict[int, Episode]                   # the seats an engine plays: their trajectories
    to_move: int = -1
    tries: int = 0                              # illegal moves in a row of the seat to move
    moves: int = 0
    illegal: dict[int, int] = field(default_factory=dict)
    returns: list[float] | None = None          # set when the game ends
    end_reason: str | None = None
    costs: dict[int, float] = field(default_factory=dict)      # of retried illegal moves, per seat

    def end(self, reason: str, returns: list[float]) -> None:
        self.end_reason, self.returns = reason, returns
        for seat, episode in self.seats.items():
            episode.end_reason, episode.reward = reason, returns[seat] - self.costs.get(seat, 0.0)


def _advance(game: _Game, action: str | None, cfg: GameConfig) -> str | None:
    """In a worker thread, bounded in time: the mover's `action` (None: a new game), then the bots' moves, until a
    seat an engine plays is to move (its next message, returned) or the game is over (None)."""
    env, n = game.env, len(game.players)
    if action is None:
        env.reset(game.row)
    else:
        why = env.step(action)
        if why is not None:
            game.illegal[game.to_move] = game.illegal.get(game.to_move, 0) + 1
            if cfg.illegal == "retry" and game.tries < cfg.retries:
                game.tries += 1
                game.costs[game.to_move] = game.costs.get(game.to_move, 0.0) + cfg.illegal_cost
                return f"{why}\n{env.observation(game.to_move)}"
            game.end("done", [cfg.illegal_reward if s == game.to_move else 0.0 for s in range(n)])
            return None
        game.moves += 1
    game.tries = 0
    while True:
        seat = env.current_player()
        if not isinstance(seat, numbers.Integral) or not -1 <= seat < n:
            raise ValueError(f"current_player() is {seat!r} in a game of {n} players: players and turns disagree")
        if seat == -1:
            returns = [float(r) for r in env.returns()]
            if len(returns) != n or not all(math.isfinite(r) for r in returns):
                raise ValueError(f"returns() gave {returns!r:.60}, not {n} finite numbers")
            game.end("done", returns)
            return None
        if game.players[seat] in ENGINE_PLAYERS:
            game.to_move = seat
            return env.observation(seat)
        why = env.step(env.bot_move(game.players[seat]))
        if why is not None:
            raise ValueError(f"bot {game.players[seat]} made an illegal move: {why}")
        game.moves += 1


def _advanced(game: _Game, action: str | None, cfg: GameConfig) -> str | None | Exception:
    try:
        return _advance(game, action, cfg)
    except (Exception, SystemExit) as err:
        return err


def play_games(engines: dict, tokenizer, game_class, rows: list[dict], row_ids: list[int], opponents: list[str],
               seats: list[int], sampling: SamplingConfig, env_cfg: EnvConfig, cfg: GameConfig, seed: int,
               greedy: bool = False) -> Rollout:
    """G games per row (1 when greedy) against the row's opponent (`self`: the policy in every seat), the policy
    in the row's seat. Every round, each game's seat to move plays: the engines (`engines["policy"]`, and
    `engines["frozen"]` where it plays) one lock-step turn each (each seat's vLLM session continued), the games'
    moves in parallel threads. The Rollout holds the trained seats' trajectories, row by row, seat by seat, G games
    each (the GRPO groups)."""
    with subreaping():
        return _play(engines, tokenizer, game_class, rows, row_ids, opponents, seats, sampling, env_cfg, cfg, seed,
                     greedy)


def _play(engines, tokenizer, game_class, rows, row_ids, opponents, seats, sampling, env_cfg, cfg, seed, greedy):
    G = 1 if greedy else sampling.num_generations
    everyone = opponents_of(cfg)
    games, trained = [], []         # trained: (game, seat) in rollout order
    for row, row_id, opponent, seat in zip(rows, row_ids, opponents, seats):
        row_games = []
        for g in range(G):
            env = game_class(**env_cfg.args)
            players = ["policy"] * env.players if opponent == "self" else \
                ["policy" if s == seat else opponent for s in range(env.players)]
            row_games.append(_Game(env, row | {"episode": seed * 1_000_003 + g}, row_id, everyone.index(opponent),
                                   players,
                                   {s: Episode(env, []) for s, p in enumerate(players) if p in ENGINE_PLAYERS}))
        games += row_games
        for s in (range(row_games[0].env.players) if opponent == "self" else [seat]):
            trained += [(game, s) for game in row_games]
    spared = frozenset(descendants(os.getpid()))
    limit, end = max_model_len(engines["policy"]), turn_end(tokenizer)
    env_seconds = time.perf_counter()
    views = bounded_calls(lambda game, _: _advanced(game, None, cfg), games, [None] * len(games), env_cfg, spared)
    env_seconds = time.perf_counter() - env_seconds
    running = games
    sessions = {player: Sessions(engines[player].llm_engine) for player in ENGINE_PLAYERS if engines.get(player)}
    try:
        for turn in range(env_cfg.max_turns * max(len(g.players) for g in games)):
            playing = [g for g, view in zip(running, views) if _give_view(g, view, tokenizer, env_cfg, limit, end.text)]
            still = {id(g) for g in playing}
            for game in (g for g in running if id(g) not in still):      # over: its seats' sessions freed
                for seat, episode in game.seats.items():
                    sessions[game.players[seat]].end(id(episode))
            running = playing
            if not running:
                break
            actions = {}
            for player in ENGINE_PLAYERS:
                movers = [g for g in running if g.players[g.to_move] == player]
                if movers:
                    actions |= _moves(sessions[player], movers, sampling, env_cfg, greedy, seed + turn, limit,
                                      end.ids)
            t0 = time.perf_counter()
            views = bounded_calls(lambda game, action: _advanced(game, action, cfg), running,
                                  [actions[id(g)] for g in running], env_cfg, spared)
            env_seconds += time.perf_counter() - t0
    finally:
        for engine_sessions in sessions.values():
            engine_sessions.close()
    for game in games:
        if game.end_reason is None:
            game.end("max_turns", [0.0] * len(game.players))
    return _game_rollout(trained, tokenizer.pad_token_id, env_seconds)


def _give_view(game: _Game, view, tokenizer, env_cfg: EnvConfig, limit: int, end_text: str) -> bool:
    """The mover's next message into its trajectory; False when the game is over (or ends here: an error, a
    view that does not fit the seat's budget)."""
    if isinstance(view, BaseException) or (view is None and game.end_reason is None):
        what = view if isinstance(view, BaseException) else "no answer"
        env_error(f"{type(game.env).__name__} {type(what).__name__}",
                  f"{type(game.env).__name__} failed: {type(what).__name__}: {what}")
        game.end("env_error", [0.0] * len(game.players))
        return False
    if view is None:
        return False
    if not isinstance(view, str):
        env_error(f"{type(game.env).__name__}.observation type",
                  f"{type(game.env).__name__}.observation returned {type(view).__name__}, not a string")
        game.end("env_error", [0.0] * len(game.players))
        return False
    episode = game.seats[game.to_move]
    if not episode.prompt_ids:
        episode.prompt_ids = chat_prompt_ids(tokenizer, view)
    else:
        ids = observation_ids(tokenizer, view, "end", "user", env_cfg.max_observation_tokens, end_text)
        episode.ids += ids
        episode.model_mask += [0] * len(ids)
        episode.logprobs += [0.0] * len(ids)
    if len(episode.ids) >= env_cfg.max_episode_tokens or len(episode.context()) >= limit:
        game.end("budget", [0.0] * len(game.players))
        return False
    return True


def _moves(sessions: Sessions, movers: list[_Game], sampling: SamplingConfig, env_cfg: EnvConfig, greedy: bool,
           seed: int, limit: int, end_ids) -> dict[int, str]:
    """One lock-step turn for the movers' seats on an engine, each seat's session continued (its KV cache kept):
    each game's move text, by the game's id."""
    episodes = [g.seats[g.to_move] for g in movers]
    params = [sampling_params(sampling, greedy, n=1, stop_token_ids=list(end_ids),
                              max_tokens=turn_room(e, sampling, env_cfg, limit)) for e in episodes]
    with seeded_draws(seed):
        turns = sessions.turns([id(e) for e in episodes], [e.context() for e in episodes], params)
    return {id(g): take_turn(e, turn, [])[0] for g, e, turn in zip(movers, episodes, turns)}


def game_outcomes(returns: Tensor) -> dict[str, Tensor]:
    """Win / draw / loss of each trajectory by the sign of its seat's game return (zero-sum games)."""
    return {"win": (returns > 0).float(), "draw": (returns == 0).float(), "loss": (returns < 0).float()}


def _game_rollout(trained: list[tuple[_Game, int]], pad_id: int, env_seconds: float) -> Rollout:
    episodes = [game.seats[seat] for game, seat in trained]
    counts = {"seat": [seat for _, seat in trained], "opponent": [game.opponent for game, _ in trained],
              "moves": [game.moves for game, _ in trained],
              "illegal": [game.illegal.get(seat, 0) for game, seat in trained],
              "end_illegal": [game.illegal.get(seat, 0) > 0 and game.end_reason == "done" and
                              game.returns[seat] < 0 for game, seat in trained]}
    rollout = to_rollout(episodes, [game.row_id for game, _ in trained], pad_id, env_seconds, counts)
    rollout.episode |= game_outcomes(torch.tensor([game.returns[seat] for game, seat in trained]))
    return rollout


class RAE:
    """Role-conditioned advantage estimation (SPIRAL): A = return - b[opponent, seat], the baseline an EMA of the
    mean return of that (opponent, seat) over the policy ranks, updated with this step's returns first."""

    def __init__(self, decay: float, state: dict[str, float] | None = None):
        self.decay, self.baselines = decay, dict(state or {})

    def __call__(self, returns: Tensor, episode: dict[str, Tensor], group: dist.ProcessGroup | None) -> Tensor:
        """The advantages of `returns`, trajectories of the games whose statistics `episode` holds."""
        keys = [f"{int(o)}:{int(s)}" for o, s in zip(episode["opponent"].tolist(), episode["seat"].tolist())]
        names = sorted(set(keys))
        everywhere = [None] * (dist.get_world_size(group) if group is not None else 1)
        if group is not None:
            dist.all_gather_object(everywhere, names, group=group)
        else:
            everywhere = [names]
        names = sorted({k for ks in everywhere for k in ks})
        sums = torch.zeros(len(names), 2, dtype=torch.float64)
        for i, name in enumerate(names):
            mine = torch.tensor([k == name for k in keys])
            sums[i] = torch.tensor([returns[mine].double().sum().item(), mine.sum().item()])
        if group is not None:
            dist.all_reduce(sums, group=group)
        for name, (total, n) in zip(names, sums.tolist()):
            mean = total / n
            old = self.baselines.get(name)
            self.baselines[name] = mean if old is None else self.decay * old + (1 - self.decay) * mean
        return returns - torch.tensor([self.baselines[k] for k in keys], dtype=returns.dtype)

    def state_dict(self) -> dict[str, float]:
        return dict(self.baselines)
