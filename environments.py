"""Environments for multi-turn episodes: each is one small class (the protocol is in forge_core/env.py).

    env:
      name: Calculator                  # a class in this file; or your own: "my_env.py:Maze"
      max_turns: 3

`reset(row)` turns a data set row into the first user message; `step(action)` answers each model turn with
(observation, reward, done). Tools are plain functions an environment calls. The shipped tool environments use
a built-in call format: the model writes `<calc>...</calc>` (or `<python>...</python>`), which is one of the
environment's `stop` strings, so the engine pauses there; the result comes back inside the same message
(`<result>...</result>`), and the model goes on. The tiny model's tokenizer has no tool-call template, and an
inline result costs no chat headers; an environment that sets `observation_role = "tool"` and leaves `stop`
empty gets its observations as chat messages instead (the chat-template way, for models whose template has tools).
"""

import ast
import copy
import difflib
import functools
import operator
import re

import numpy as np
import pyspiel
from open_spiel.python.algorithms import mcts

from forge_core.config import ForgeError
from forge_core.sandbox import SandboxConfig, run_python
from rewards import extract_gsm8k_answer

__all__ = ["calculate", "Calculator", "GuessNumber", "PythonTool", "OpenSpielGame"]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str, max_length: int = 100, max_magnitude: float = 1e15) -> str:
    """Arithmetic on numbers (+ - * / // % **, parentheses), parsed, never `eval`ed; bounded in size."""
    if len(expression) > max_length:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            result = _OPERATORS[type(node.op)](left, right)
            if abs(result) > max_magnitude:
                raise ValueError("number too large")
            return result
        raise ValueError("only numbers and + - * / // % ** ( )")
    try:
        result = value(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class Calculator:
    """Arithmetic with a calculator: `<calc>37*48</calc>` -> `<result>1776</result>`, then the answer. Reward 1
    when the final message (the text after the last result) is `row["answer"]`."""
    stop = ["</calc>"]

    def reset(self, row: dict) -> str:
        self.answer, self.tool_errors = str(row["answer"]).strip(), 0
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        call = re.search(r"<calc>(.*)</calc>\s*$", action, re.S)
        if call is None:
            return "", float(action.strip() == self.answer), True
        try:
            result = calculate(call.group(1))
        except ValueError as err:
            self.tool_errors += 1
            result = f"error: {err}"
        return f"<result>{result}</result>", 0.0, False


class GuessNumber:
    """Find a secret number from "higher" / "lower" replies (each a new user message). Reward 0.9 ** (guesses
    - 1) when found: fewer guesses, more reward; 0 when the turns run out."""

    def reset(self, row: dict) -> str:
        self.secret, self.guesses = int(row["answer"]), 0
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        self.guesses += 1
        guess = action.strip()
        if not guess.isdigit():
            return "a number, please", 0.0, False
        if int(guess) == self.secret:
            return "", 0.9 ** (self.guesses - 1), True
        return ("higher" if int(guess) < self.secret else "lower"), 0.0, False


class PythonTool:
    """Word problems with a Python interpreter: `<python>print(12*7)</python>` runs in the sandbox
    (forge_core/sandbox.py: no network, limits, nothing outlives the call) -> `<output>84</output>`. Reward 1
    when the final message's answer (GSM8K extraction: `#### N`, \\boxed{}, or the last number) is the gold one."""
    stop = ["</python>"]
    sandbox = SandboxConfig(timeout_s=5.0, cpu_seconds=5, memory_mb=256, max_output_bytes=512)

    instruction = ("Solve the problem. To compute, write Python between <python> and </python>; what it prints "
                   "comes back between <output> and </output>. End with the answer as #### N.\n\n")

    def reset(self, row: dict) -> str:
        self.answer = extract_gsm8k_answer(str(row["answer"]))
        self.tool_errors = self.tool_timeouts = 0
        return self.instruction + row.get("question", row.get("prompt", ""))

    def step(self, action: str) -> tuple[str, float, bool]:
        call = re.search(r"<python>(.*)</python>\s*$", action, re.S)
        if call is None:
            return "", float(self.answer is not None and extract_gsm8k_answer(action) == self.answer), True
        result = run_python(call.group(1), self.sandbox)
        self.tool_timeouts += result.timed_out
        self.tool_errors += not result.timed_out and result.exit_code != 0
        return f"<output>{result.observation().strip()}</output>", 0.0, False


class OpenSpielGame:
    """Any OpenSpiel game with a text view, as a game of forge_core/games.py: `env.args: {game: kuhn_poker}`.
    A seat's message is its view (`observation_string`, or `information_state_string` for `view:
    information_state`), after `You are player N of GAME.` on its first turn, with the legal moves listed when
    `list_moves`; a move is one of them as OpenSpiel writes it (`x(1,1)`, `Bet`) or its action number (`numbered`:
    moves are listed and the bots write them as numbers, TicTacToe's cells 0-8: one token each). Chance
    nodes are drawn from the row's `seed` (a GRPO group's games share their deals); the bots' draws differ per game.
    Bots: `random`, and for perfect-information games `mcts` (OpenSpiel's MCTSBot, `mcts_simulations` per move).
    `exploitability`: held-out evaluations also read the model's policy out at every information state and report
    OpenSpiel's exploitability of it (two-player zero-sum games with few states: Kuhn Poker's 12)."""

    def __init__(self, game: str = "tic_tac_toe", view: str = "observation", list_moves: bool = False,
                 numbered: bool = False, mcts_simulations: int = 100, exploitability: bool = False):
        self.game, self.name, self.report_exploitability = _openspiel_game(game), game, exploitability
        self.players = self.game.num_players()
        self.information_state = view == "information_state"
        self.list_moves, self.numbered, self.mcts_simulations = list_moves, numbered, mcts_simulations
        perfect = self.game.get_type().information == pyspiel.GameType.Information.PERFECT_INFORMATION
        self.bots = ("random", "mcts") if perfect else ("random",)

    def reset(self, row: dict) -> None:
        self.state = self.game.new_initial_state()
        seed = int(row.get("seed", 0))
        self.chance = np.random.RandomState(seed % 2**32)
        self.bot_draws = np.random.RandomState((seed * 7919 + int(row.get("episode", 0))) % 2**32)
        self.mcts, self.introduced = None, set()
        self._draw_chance()

    def current_player(self) -> int:
        return -1 if self.state.is_terminal() else self.state.current_player()

    def observation(self, seat: int) -> str:
        view = (self.state.information_state_string(seat) if self.information_state
                else self.state.observation_string(seat))
        if self.list_moves:
            view += "\nLegal moves: " + " ".join(self._legal())
        intro = "" if seat in self.introduced else f"You are player {seat} of {self.name}.\n"
        self.introduced.add(seat)
        return intro + view

    def step(self, action: str) -> str | None:
        if self.state.is_terminal():
            raise ForgeError(f"game error: a move ({action.strip()!r:.20}) for a finished {self.name} game")
        seat, actions = self.state.current_player(), self.state.legal_actions()
        legal = {self.state.action_to_string(seat, a).lower(): a for a in actions}
        move = action.strip().lower()
        chosen = legal.get(move, int(move) if move.isdigit() and int(move) in actions else None)
        if chosen is None:
            return f"Illegal move {action.strip()[:20]!r}. Legal moves: {' '.join(self._legal())}"
        self.state.apply_action(chosen)
        self._draw_chance()
        return None

    def returns(self) -> list[float]:
        return list(self.state.returns())

    def bot_move(self, name: str) -> str:
        if name == "mcts":
            if self.mcts is None:
                evaluator = mcts.RandomRolloutEvaluator(1, self.bot_draws)
                self.mcts = mcts.MCTSBot(self.game, 2.0, self.mcts_simulations, evaluator,
                                         random_state=self.bot_draws, solve=True)
            action = self.mcts.step(self.state)
        else:
            action = self.bot_draws.choice(self.state.legal_actions())
        return self._written(action)

    def exploitability(self, policy) -> float | None:
        """OpenSpiel's exploitability of `policy`: for each chat (the mover's views and own moves up to an
        information state, its legal moves) the probability of each legal move. None unless asked for."""
        if not self.report_exploitability:
            return None
        from open_spiel.python import policy as policy_lib
        from open_spiel.python.algorithms import exploitability
        table = policy_lib.TabularPolicy(self.game)
        for state, probabilities in zip(table.states, policy([self._chat(state) for state in table.states])):
            row = table.policy_for_key(state.information_state_string())
            row[:] = 0.0
            row[state.legal_actions()] = probabilities
        return float(exploitability.exploitability(self.game, table))

    def _chat(self, state) -> tuple[list[str], list[str], list[str]]:
        """What the seat to move at `state` saw and played to get there (perfect recall): its views, its own
        moves between them, and its legal moves now."""
        seat, replay = state.current_player(), copy.copy(self)
        replay.state, replay.introduced = self.game.new_initial_state(), set()
        views, moves = [], []
        for action in state.history():
            if replay.state.current_player() == seat:
                views.append(replay.observation(seat))
                moves.append(replay._written(action))
            replay.state.apply_action(action)
        return [*views, replay.observation(seat)], moves, replay._legal()

    def _legal(self) -> list[str]:
        return [self._written(a) for a in self.state.legal_actions()]

    def _written(self, action: int) -> str:
        return str(action) if self.numbered else self.state.action_to_string(self.state.current_player(), action)

    def _draw_chance(self) -> None:
        while self.state.is_chance_node():
            actions, probabilities = zip(*self.state.chance_outcomes())
            self.state.apply_action(int(self.chance.choice(actions, p=probabilities)))


@functools.cache
def _openspiel_game(name: str):
    known = pyspiel.registered_names()      # asked first: a failed load_game prints every name to stderr
    if name.split("(")[0] not in known:
        close = difflib.get_close_matches(name, known, n=3)
        raise ForgeError(f"config error: env.args.game: OpenSpiel has no game '{name}'"
                         + (f" (did you mean {', '.join(close)}?)" if close else ""))
    return pyspiel.load_game(name)
