"""One policy rank (torchrun) with two engines, the policy's and a frozen opponent's, playing TicTacToe
(tests/envs_for_tests.py's recording and rejecting games): each seat's trajectory holds its own moves as model
tokens and the rest as observations; the engine's logprobs are the trainer's; bots move only for their seats;
illegal moves lose or retry as configured; the frozen engine keeps the file's weights while the policy's engine
follows the trainer, until a refresh; the pool of snapshots writes exactly the one drawn into the frozen engine,
also after a checkpoint's round trip; the move probabilities read out for Kuhn Poker's exploitability are the
trainer's; a seat's advantages (and loss gradients) ignore the other seat's returns.

    torchrun --nproc_per_node 1 tests/games_check.py MODEL_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from environments import OpenSpielGame
from games_for_tests import RecordingGame, RejectingGame
from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine
from forge_core.env import EnvConfig
from forge_core.game_eval import move_probabilities, move_prompts
from forge_core.games import RAE, GameConfig, play_games
from forge_core.model import FSDPConfig, ModelConfig, load_tokenizer
from forge_core.optim import OptimConfig, build_optimizer, optimizer_step
from forge_core.snapshots import SnapshotPool
from forge_core.sync import WeightSync, engine_state_dict
from forge_core.weights import build_model, full_tensor, hf_tensors
from sync_check import fuse_like_vllm
from train_grpo import LossConfig, grpo_loss, group_advantages, loss_scale, token_logprobs

G = 4
ENV = EnvConfig(args={"game": "tic_tac_toe", "list_moves": True, "numbered": True}, max_turns=6,
                max_episode_tokens=200, max_observation_tokens=48)
SAMPLING = SamplingConfig(num_generations=G, max_tokens=8)


def turns(tokenizer, ids: torch.Tensor, mask: torch.Tensor, model: bool) -> list[str]:
    """The texts of a trajectory's runs of model (or observation) tokens."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist()):
        if m == model:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(r, skip_special_tokens=True) for r in runs]


EVERY_OPPONENT = dict(eval_opponents=["random", "mcts", "frozen"])


def play(engines, tokenizer, game_class, opponents, seats, cfg=GameConfig(**EVERY_OPPONENT), seed=1):
    made = []
    counting = type("Counted", (game_class,), {"__init__": lambda self, **a: (game_class.__init__(self, **a),
                                                                             made.append(self))[0]})
    rows = [{"seed": k} for k in range(len(opponents))]
    rollout = play_games(engines, tokenizer, counting, rows, list(range(len(rows))), opponents, seats, SAMPLING, ENV,
                         cfg, seed)
    return rollout, made


def main(model_dir: str, out_dir: str) -> None:
    roles = init_roles(Layout(policy=1, reference=0, reward=0))
    cfg = ModelConfig(path=model_dir)
    tokenizer = load_tokenizer(cfg)
    policy = build_model(cfg, roles.policy_mesh, FSDPConfig(), seed=0)
    engines = {p: build_engine(model_dir, EngineConfig(block_size=32), seed=0) for p in ("policy", "frozen")}
    result = {}

    # self-play: seat s of game g is trajectory (row, s, g); its model tokens are its own moves, in order
    rollout, games = play(engines, tokenizer, RecordingGame, ["self"] * 3, [0] * 3)
    own = []
    for i in range(len(rollout)):
        row, rest = divmod(i, 2 * G)
        seat, g = divmod(rest, G)
        game = games[row * G + g]
        mask, ids = rollout.model_mask[i], rollout.completion_ids[i]
        real = rollout.completion_mask[i].bool()
        # vLLM's text (the move the game got) withholds a token's incomplete UTF-8 bytes; decode writes them as U+FFFD
        mine = [t.replace("\ufffd", "") for t in turns(tokenizer, ids[real], mask[real], True)]
        own.append(mine == [a for s, a in game.moves if s == seat] and int(rollout.episode["seat"][i]) == seat)
    result["own_moves"] = all(own)
    result["trajectories"], result["games"] = len(rollout), len(games)
    result["illegal_moves_self_play"] = rollout.episode["illegal"].sum().item()
    with torch.no_grad():
        trainer, _ = token_logprobs(policy, rollout, temperature=1.0)
    loss_mask = rollout.loss_mask().bool()
    result["logprob_gap"] = (trainer - rollout.sampler_logprobs).abs()[loss_mask].max().item()

    # a seat's advantages and loss gradients do not depend on the other seat's returns (grpo and rae)
    seat0 = [i for i in range(len(rollout)) if rollout.episode["seat"][i] == 0]
    rewards = rollout.episode["return"].clone()
    other = rewards.clone()
    other[rollout.episode["seat"] == 1] = torch.randn(int((rollout.episode["seat"] == 1).sum()))
    result["grpo_seat0_unchanged"] = torch.equal(group_advantages(rewards, G, "group")[seat0],
                                                 group_advantages(other, G, "group")[seat0])
    result["rae_seat0_unchanged"] = torch.equal(RAE(0.9)(rewards, rollout.episode, None)[seat0],
                                                RAE(0.9)(other, rollout.episode, None)[seat0])
    part = rollout.select(seat0)
    gradients = []
    for r in (rewards, other):
        policy.zero_grad()
        part.advantages = group_advantages(r, G, "group")[seat0]
        logp, _ = token_logprobs(policy, part, temperature=1.0)
        loss, _ = grpo_loss(logp, part, LossConfig(importance_sampling_cap=0), loss_scale(part, 200, None, 1))
        loss.backward()
        gradients.append(torch.cat([full_tensor(p.grad).flatten() for p in policy.parameters()]))
    result["seat0_gradients_equal"] = torch.equal(*gradients) and gradients[0].abs().sum().item() > 0

    # bots move only in their seats; only the policy's seat is a trajectory
    seats = [0, 1, 0, 1]
    rollout, games = play(engines, tokenizer, RecordingGame, ["random", "random", "mcts", "mcts"], seats)
    result["bot_seats_only"] = all(set(game.bot_seats) <= {1 - seats[k // G]} and game.bot_seats
                                   for k, game in enumerate(games))
    result["trained_seats"] = rollout.episode["seat"].tolist() == [s for s in seats for _ in range(G)]

    # illegal moves: lose at once, or retry with the reason as the next message
    for mode, cfg in (("lose", GameConfig(illegal="lose", **EVERY_OPPONENT)),
                      ("retry", GameConfig(illegal="retry", retries=2, **EVERY_OPPONENT))):
        rollout, _ = play(engines, tokenizer, RejectingGame, ["random"] * 2, [0, 0], cfg)   # the policy moves first
        observations = [turns(tokenizer, rollout.completion_ids[i], rollout.model_mask[i], False)
                        for i in range(len(rollout))]
        result[f"illegal_{mode}"] = {"illegal": rollout.episode["illegal"].tolist(),
                                     "turns": rollout.episode["turns"].tolist(),
                                     "returns": rollout.episode["return"].tolist(),
                                     "reasons": [sum("No move is legal here." in o for o in obs)
                                                 for obs in observations]}

    # the frozen engine keeps the start model while the trainer and its engine move on; a refresh copies them
    rollout, _ = play(engines, tokenizer, RecordingGame, ["frozen"] * 2, [0, 1])
    result["frozen_games_trained_seats"] = rollout.episode["seat"].tolist() == [0] * G + [1] * G
    weight_sync = WeightSync(policy, engines["policy"])
    pool = SnapshotPool(WeightSync(policy, engines["frozen"]), size=2, group=None)    # the start model, snapshot 0
    optim, sched = build_optimizer(policy, OptimConfig(lr=1e-2), total_steps=2)
    start = fuse_like_vllm(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict())
    gaps = {"frozen_vs_file": [], "policy_engine_vs_trainer": [], "trainer_vs_file": []}
    for step in range(2):
        ids = torch.randint(0, 300, (4, 12))
        policy(input_ids=ids, labels=ids).loss.backward()
        optimizer_step(policy, optim, sched, max_grad_norm=0)
        weight_sync()
        play(engines, tokenizer, RecordingGame, ["frozen"], [0])
        trainer = fuse_like_vllm(dict(hf_tensors(policy)))
        frozen, served = engine_state_dict(engines["frozen"]), engine_state_dict(engines["policy"])
        gaps["frozen_vs_file"].append(max((frozen[n] - start[n]).abs().max().item() for n in frozen))
        gaps["policy_engine_vs_trainer"].append(max((served[n] - trainer[n]).abs().max().item() for n in served))
        gaps["trainer_vs_file"].append(max((trainer[n] - start[n]).abs().max().item() for n in frozen))
    def gap_to(expected: dict) -> float:
        frozen = engine_state_dict(engines["frozen"])
        return max((frozen[n] - expected[n]).abs().max().item() for n in frozen)
    pool.add()                                      # snapshot 1: the trained policy
    gaps["refreshed_vs_trainer"] = gap_to(trainer)
    pool.load(0)
    gaps["pool_0_vs_file"] = gap_to(start)
    pool.load(1)
    gaps["pool_1_vs_trainer"] = gap_to(trainer)
    path = Path(out_dir) / "pool.pt"
    torch.save(pool.state_dict(), path)
    kept = SnapshotPool(WeightSync(policy, engines["frozen"]), size=2, group=None,
                        kept=torch.load(path, weights_only=True))
    gaps["kept_newest_vs_trainer"] = gap_to(trainer)
    kept.load(0)
    gaps["kept_0_vs_file"] = gap_to(start)
    kept.add()                                      # the oldest (the start model) leaves
    kept.load(0)
    result["pool_size_after_add"], result["pool_draws"] = len(kept), sorted({kept.draw(3, r) for r in range(40)})
    gaps["pool_oldest_vs_trainer"] = gap_to(trainer)
    result["weights"] = gaps

    # Kuhn Poker's policy read out of the engine (prompt logprobs) is the trainer's
    kuhn = OpenSpielGame("kuhn_poker", view="information_state", list_moves=True, exploitability=True)
    chats = []
    kuhn.exploitability(lambda asked: chats.extend(asked) or [[0.5, 0.5] for _ in asked])
    engine_probabilities = move_probabilities(engines["policy"], tokenizer, chats, ENV)
    prompts, sizes = move_prompts(tokenizer, chats, ENV)
    with torch.no_grad():
        scores = torch.tensor([policy(input_ids=torch.tensor([ids])).logits[0, -n - 1:-1].log_softmax(-1)
                               .gather(1, torch.tensor(ids[-n:]).unsqueeze(1)).sum().item() for ids, n in prompts])
    trainer_probabilities = [part.softmax(0).tolist() for part in scores.split(sizes)]
    result["kuhn_probability_gap"] = max(abs(a - b) for e, t in zip(engine_probabilities, trainer_probabilities)
                                         for a, b in zip(e, t))
    result["kuhn_probabilities_sum"] = [round(sum(p), 6) for p in engine_probabilities]
    (Path(out_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_main(lambda: main(*sys.argv[1:]))
