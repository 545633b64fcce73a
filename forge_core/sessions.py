"""An episode's KV cache kept across its turns: vLLM's streaming-input sessions, driven from the synchronous engine.

A multi-turn episode's next turn is its whole context again. As a fresh request the engine prefills all of it but
the full KV blocks its prefix cache holds (32 tokens a block on CPU: most of a short agentic context); as the next
chunk of a session it prefills only the new tokens. vLLM offers sessions through `AsyncLLM.generate` with an input
stream; its synchronous `LLMEngine` takes the same requests from here:
- a chunk is an `EngineCoreRequest` marked `resumable`, sent under the session's internal id;
- the engine core gets its own copy of the chunk's token list (the in-process client would otherwise share it with
  the output processor, both extend it, the session counts the chunk twice and stalls);
- a turn ends with a finish reason but `finished` False, the session paused holding its KV blocks (and a slot of
  `max_num_seqs`); the turn's last sampled token was never fed to the model, so it opens the next chunk;
- a stop string is found by the output processor, which does not stop a session in the engine core: such a turn
  ends the session, and the episode's next turn opens a new one on its whole context.
A session keeps the random generator of its first chunk (vLLM's model runner does not reseed a resumed session):
each episode's draws follow its own seed, whatever shares its engine steps. Outputs come as deltas, gathered here
into one `Turn` per model turn. Greedy turns give the tokens and logprobs of a fresh request on the whole context
(tests/continuous_check.py).
"""

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # vLLM only where an engine runs: the reference and reward ranks never import it
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

__all__ = ["Sessions", "Turn"]


@dataclass
class Turn:
    """A model turn as `take_turn` reads it (the fields of vLLM's CompletionOutput it uses)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Session:
    request: "EngineCoreRequest"    # its first chunk
    held: int           # context tokens in the session's KV cache (or about to be: the chunks sent so far)
    turn: Turn


class Sessions:
    """One session per key (an episode): `send` its context each turn, `step` the engine, `end` it when done; or a
    lock-step turn of many: `turns`."""

    def __init__(self, llm_engine):
        self.engine = llm_engine
        self.tasks = llm_engine.get_supported_tasks()
        self.open: dict[int, _Session] = {}
        self.running: set[int] = set()          # the keys whose turn the engine is sampling

    def send(self, key: int, context: list[int], params: "SamplingParams", keep: bool = True) -> None:
        """The episode's next turn: the tokens of `context` its session does not hold yet (all of them for a new
        session: the first turn, or the one after a stop string). A session's later chunks are copies of its first
        request (vLLM's input processing of a chunk cost more than its engine step): within an episode the turns'
        sampling params differ only in `max_tokens`. `keep` False: a plain request on the whole context instead,
        ended with its turn (its KV blocks go back to the prefix cache)."""
        from vllm.sampling_params import RequestOutputKind
        if not keep:
            self.end(key)
        session = self.open.get(key)
        new = session is None
        if new:
            params.output_kind = RequestOutputKind.DELTA
            request = self.engine.input_processor.process_inputs(
                str(key), {"prompt_token_ids": list(context)}, params, supported_tasks=self.tasks, resumable=keep)
            self.engine.input_processor.assign_request_id(request)
            session = self.open[key] = _Session(request, 0, Turn())
        else:
            request = copy.copy(session.request)
            request.prompt_token_ids = context[session.held:]
            request.sampling_params = copy.copy(session.request.sampling_params)
            request.sampling_params.max_tokens = params.max_tokens
            request.arrival_time = time.time()
        session.held, session.turn = len(context), Turn()
        self.running.add(key)
        self.engine.output_processor.add_request(request, None, None, 0)
        if new:     # the logprobs' tokens go undecoded (their text is never read: a tokenizer call per token)
            self.engine.output_processor.request_states[request.request_id].logprobs_processor.tokenizer = None
        core = copy.copy(request)
        core.prompt_token_ids = list(request.prompt_token_ids)
        self.engine.engine_core.add_request(core)

    def step(self) -> list[tuple[int, Turn]]:
        """One engine step; the turns it ended, with their keys."""
        ended = []
        for out in self.engine.step():
            key = int(out.request_id)
            session, delta = self.open[key], out.outputs[0]
            turn = session.turn
            turn.text += delta.text
            turn.token_ids += delta.token_ids
            turn.logprobs += delta.logprobs or []
            if delta.finish_reason is None:
                continue
            turn.finish_reason, turn.stop_reason = delta.finish_reason, delta.stop_reason
            ended.append((key, turn))
            self.running.discard(key)
            if isinstance(delta.stop_reason, str):     # a stop string: the engine core would go on sampling
                self.end(key)
            elif out.finished:                          # a request not kept
                del self.open[key]
            else:
                session.held += len(turn.token_ids) - 1
        return ended

    def turns(self, keys: list[int], contexts: list[list[int]], params: list["SamplingParams"]) -> list[Turn]:
        """One lock-step turn: each key's next turn sent, in order, and the engine stepped until all of them ended;
        their turns in the order of `keys`. The sessions are kept where the engine can hold them all, with the
        turn's tokens, at once (a paused session keeps its slot of the scheduler's running requests and its KV
        blocks: with one too many, a turn would wait for a slot forever); else the turn's requests are plain ones."""
        turn = set(keys)
        others = [session.held for key, session in self.open.items() if key not in turn]
        keep = self.holds([len(c) + p.max_tokens for c, p in zip(contexts, params)] + others)
        for key, context, turn_params in zip(keys, contexts, params):
            self.send(key, context, turn_params, keep)
        ended: dict[int, Turn] = {}
        while self.running:
            ended.update(self.step())
        return [ended[key] for key in keys]

    def holds(self, tokens: list[int]) -> bool:
        """Whether the engine holds sessions of these lengths at once: a slot each, and their KV blocks."""
        slots, blocks, block = self._room()
        return len(tokens) <= slots and sum(-(-n // block) for n in tokens) <= blocks

    def capacity(self, tokens: int) -> int:
        """How many sessions of up to `tokens` tokens each the engine holds at once."""
        slots, blocks, block = self._room()
        return max(1, min(slots, blocks // -(-tokens // block)))

    def _room(self) -> tuple[int, int, int]:
        """The scheduler's running requests, the KV cache's blocks and a block's tokens."""
        config = self.engine.vllm_config
        scheduler, cache = config.scheduler_config, config.cache_config
        return scheduler.max_num_active_seqs or scheduler.max_num_seqs, cache.num_gpu_blocks, cache.block_size

    def end(self, key: int) -> None:
        """Free the episode's session (its KV blocks and its slot); a later `send` opens a new one."""
        session = self.open.pop(key, None)
        self.running.discard(key)
        if session is not None:
            self.engine.abort_request([session.request.request_id], internal=True)

    def close(self) -> None:
        for key in list(self.open):
            self.end(key)
