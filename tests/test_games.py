"""Multi-agent games (forge_core/games.py, environments.py:OpenSpielGame): the seats' trajectories, opponents
(self, frozen, bots), illegal moves, RAE, and self-play GRPO on TicTacToe that learns."""

import json
import re

import pytest

from conftest import REPO, assert_clean_error, assert_same_curve, built_once, read_metrics, run_script, trained_sft
from environments import OpenSpielGame
from games_for_tests import SeatlessGame
from forge_core.config import ForgeError
from forge_core.env import EnvConfig
from forge_core.games import GameConfig, check_game

SCORE = re.compile(r"score vs (\w+): ([\d.]+) -> ([\d.]+) \((\d+) games, s\.e\. [\d.]+\)")
ILLEGAL = re.compile(r"illegal moves: ([\d.]+) -> ([\d.]+) of moves")


@pytest.fixture(scope="session")
def tictactoe_sft(tmp_path_factory, worker_id):
    """configs/sft/tiny_tictactoe.yaml's SFT on random legal play (`make run-selfplay`'s first half) at a fifth of
    the cost: a row per game and seat with every move trained (data.every_assistant_turn), 250 steps of 16 packed
    rows, not 300 of 128 per-move rows (on a Zen 3 its greedy play scores 0.510 vs random, 0.021 of its moves
    illegal, in 95 s; 100 steps of 128 per-move rows lose every game by an illegal move, as do 200 or 400 of 32)."""
    def sft(out):
        trained_sft(out, "tictactoe", "configs/sft/tiny_tictactoe.yaml", 250, "--train.batch_size", "16",
                    "--train.micro_batch_size", "8", "--data.pack", "--data.every_assistant_turn",
                    "--data.path", str(out / "artifacts" / "data" / "conversations.jsonl"))
    return built_once(tmp_path_factory, worker_id, "tictactoe_sft", sft)


def selfplay(sft, out, *extra: str, config: str = "configs/grpo/tiny_tictactoe.yaml"):
    data = sft / "artifacts" / "data"
    return run_script("train_grpo.py", ["--config", config, "--model.path",
                                        str(sft / "sft" / "hf"), "--data.path", str(data / "games.jsonl"),
                                        "--data.eval_path", str(data / "eval_games.jsonl"), "--out_dir", str(out),
                                        *extra], nproc=2)


def test_seats_opponents_and_illegal_moves_on_real_engines(tictactoe_sft, tmp_path):
    """tests/games_check.py: a seat's model tokens are exactly its own moves (the opponent's reach it only inside
    observations), engine logprobs are the trainer's, bots move only for their seats, an illegal move loses or is
    retried with its reason, the frozen engine keeps the start model while the policy's follows the trainer (a
    refresh copies it, a pool of snapshots writes exactly the one drawn), a seat's advantages and gradients ignore
    the other seat's returns, and Kuhn Poker's move probabilities read out of the engine are the trainer's."""
    run_script("tests/games_check.py", [str(tictactoe_sft / "sft" / "hf"), str(tmp_path)], nproc=1)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["own_moves"]
    assert result["trajectories"] == 2 * result["games"]
    assert result["logprob_gap"] < 1e-5
    assert result["grpo_seat0_unchanged"] and result["rae_seat0_unchanged"] and result["seat0_gradients_equal"]
    assert result["bot_seats_only"] and result["trained_seats"] and result["frozen_games_trained_seats"]
    lose, retry = result["illegal_lose"], result["illegal_retry"]
    assert lose["illegal"] == lose["turns"] == [1.0] * 8 and lose["returns"] == [-1.0] * 8
    assert lose["reasons"] == [0] * 8
    assert retry["illegal"] == retry["turns"] == [3.0] * 8 and retry["returns"] == [-1.0] * 8
    assert retry["reasons"] == [2] * 8          # each retry's message names the reason
    weights = result["weights"]
    assert weights["frozen_vs_file"] == [0.0, 0.0] and weights["policy_engine_vs_trainer"] == [0.0, 0.0]
    assert min(weights["trainer_vs_file"]) > 1e-3 and weights["refreshed_vs_trainer"] == 0.0
    assert weights["pool_0_vs_file"] == weights["pool_1_vs_trainer"] == 0.0
    assert weights["kept_newest_vs_trainer"] == weights["kept_0_vs_file"] == weights["pool_oldest_vs_trainer"] == 0.0
    assert result["pool_size_after_add"] == 2 and result["pool_draws"] == [0, 1]
    assert result["kuhn_probability_gap"] < 1e-5 and result["kuhn_probabilities_sum"] == [1.0] * 12


def test_selfplay_learns_tictactoe(tictactoe_sft, tmp_path):
    """`make run-selfplay`, shortened: GRPO self-play raises the greedy score against OpenSpiel's random player
    (200 held-out games, the model in each seat half of them), and the sampled games' illegal moves fall (greedy
    play has few from the start: 0.013 of its moves)."""
    proc = selfplay(tictactoe_sft, tmp_path, "--train.steps", "12", "--train.eval_every", "0",
                    "--game.eval_opponents", "random")
    (opponent, start, end, games), = SCORE.findall(proc.stdout)
    assert opponent == "random" and int(games) == 200
    assert float(end) > float(start) + 0.1, proc.stdout[-2000:]
    assert ILLEGAL.search(proc.stdout), proc.stdout[-2000:]
    illegal = [read_metrics(tmp_path)[step]["episode/illegal"] for step in range(1, 13)]   # sampled: falls first
    assert sum(illegal[-4:]) < sum(illegal[:4]), illegal


def test_rae_baselines_and_the_snapshot_pool_survive_a_resume(tictactoe_sft, tmp_path):
    """RAE's EMA baselines and the frozen opponent's pool of snapshots are in the checkpoint: a run resumed from the
    straight run's step-2 checkpoint logs its step 3 (a stopped run's resume: test_grpo_e2e.py); half the games in
    self-play, a quarter each against the random bot and a frozen opponent (its own engine) drawn per row from a
    pool of the last 3 snapshots, one a step."""
    config = tmp_path / "mixed.yaml"
    config.write_text((REPO / "configs/grpo/tiny_tictactoe.yaml").read_text().replace(
        "    self: 1.0", "    self: 0.5\n    frozen: 0.25\n    random: 0.25"))
    extra = ("--train.steps", "3", "--train.prompts_per_step", "8", "--train.eval_every", "0", "--data.eval_rows", "8",
             "--ckpt.save_every", "2", "--game.advantage", "rae", "--game.frozen_refresh_every", "1",
             "--game.pool_size", "3")
    selfplay(tictactoe_sft, tmp_path / "straight", *extra, config=str(config))
    selfplay(tictactoe_sft, tmp_path / "resumed", *extra, "--ckpt.resume",
             str(tmp_path / "straight" / "checkpoints" / "step_000002"), config=str(config))
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert_same_curve(resumed, straight, range(3, 4))
    meta = json.loads(sorted((tmp_path / "resumed").glob("checkpoints/*/meta.json"))[-1].read_text())
    assert {"0:0", "0:1"} <= set(meta["rae"]) <= {"0:0", "0:1", "1:0", "1:1", "2:0", "2:1"}   # (opponent, seat)


def test_bad_games_fail_in_one_line(tmp_path):
    """A game OpenSpiel does not know fails at start-up, before any model loads; an environment whose players and
    turns disagree, a move for a finished game, and continuous episodes for a game are one-line errors too."""
    config = tmp_path / "bad.yaml"
    config.write_text((REPO / "configs/grpo/tiny_tictactoe.yaml").read_text().replace("game: tic_tac_toe",
                                                                                    "game: tic_tac_tow"))
    proc = run_script("train_grpo.py", ["--config", str(config), "--layout.policy", "1", "--train.prompts_per_step",
                                        "8", "--model.path", str(tmp_path / "no_model")], nproc=1, check=False)
    assert_clean_error(proc, "train_grpo.py", "OpenSpiel has no game 'tic_tac_tow' (did you mean tic_tac_toe")
    with pytest.raises(ForgeError, match="players and turns disagree"):
        check_game(SeatlessGame, EnvConfig(), GameConfig(), {"seed": 0}, 8, 8, 1, 1)
    game = OpenSpielGame()
    game.reset({"seed": 0})
    for move in ("x(0,0)", "o(1,0)", "x(0,1)", "o(1,1)", "x(0,2)"):
        assert game.step(move) is None
    assert game.current_player() == -1 and game.returns() == [1.0, -1.0]
    with pytest.raises(ForgeError, match=r"a move \('o\(2,2\)'\) for a finished tic_tac_toe game"):
        game.step("o(2,2)")
    with pytest.raises(ForgeError, match="game opponent 'minimax' is none of"):
        check_game(OpenSpielGame, EnvConfig(), GameConfig(opponents={"minimax": 1.0}), {"seed": 0}, 8, 8, 1, 1)
    with pytest.raises(ForgeError, match="env.schedule=continuous is for environments"):
        check_game(OpenSpielGame, EnvConfig(schedule="continuous"), GameConfig(), {"seed": 0}, 8, 8, 1, 1)


def test_kuhn_exploitability_reads_every_information_state():
    """OpenSpielGame's exploitability asks the policy once per information state, with the chat that seat saw and
    played to get there, and is OpenSpiel's figure for the policy read out (uniform: 0.4583, always betting: 1/3)."""
    game = OpenSpielGame("kuhn_poker", view="information_state", list_moves=True, exploitability=True)
    asked = []

    def uniform(chats):
        asked.extend(chats)
        return [[1 / len(legal)] * len(legal) for _, _, legal in chats]
    assert game.exploitability(uniform) == pytest.approx(0.458333, abs=1e-5)
    assert len(asked) == 12 and all(legal == ["Pass", "Bet"] for _, _, legal in asked)
    views, moves, _ = next(chat for chat in asked if len(chat[0]) == 2)     # player 0: passed, then player 1 bet
    assert views[0].startswith("You are player 0 of kuhn_poker.") and moves == ["Pass"]
    assert views[1].split("\n")[0].endswith("pb") and not views[1].startswith("You are")
    assert game.exploitability(lambda chats: [[0.0, 1.0] for _ in chats]) == pytest.approx(1 / 3, abs=1e-6)
    assert OpenSpielGame("kuhn_poker").exploitability(uniform) is None       # not asked for
