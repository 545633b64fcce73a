"""A torchrun program (1 rank) for tests/test_agentic.py: the same episodes played in lock-step turns and as
continuous episodes (`env.schedule`) on the tiny model's real engine, 16 prompts; prints one JSON line: whether the
greedy episodes of each schedule (their turns continuing vLLM sessions) are those of lock-step turns sent as fresh
requests on the whole context (token ids, masks, end reasons, returns, engine logprobs within 1e-5),
for Chatter and for Tortoise (whose answers come back out of order), how many turns of its four continuous rollouts went to the engine as
the next chunk of their episode's session (its KV cache kept) and how many opened one (first turns, and turns after
a stop string), and whether sampled continuous episodes are the same again with the same seed and differ with another.

    torchrun --standalone --nproc_per_node 1 tests/continuous_check.py MODEL_DIR
"""

import dataclasses
import json
import sys

import torch

from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine
from forge_core.env import EnvConfig, engine_args, load_env, run_episodes
from forge_core.model import ModelConfig, load_tokenizer
from forge_core.sessions import Sessions
from train_grpo import ENVIRONMENTS_PY


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("completion_ids", "completion_mask", "model_mask")) \
        and all(torch.equal(a.episode[k], b.episode[k]) for k in a.episode) \
        and torch.allclose(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5, rtol=0)


def counted_sends() -> dict[str, int]:
    """Counts `Sessions.send` calls that continue a session and that open one."""
    counts, send = {"resumed": 0, "opened": 0}, Sessions.send

    def counting(self, key, context, params, keep=True):
        counts["resumed" if key in self.open and keep else "opened"] += 1
        return send(self, key, context, params, keep)
    Sessions.send = counting
    return counts


def main(model_dir: str) -> None:
    sends = counted_sends()
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    # 32 sequences at once: the 16 greedy episodes fit as sessions, the 64 sampled ones do not (lock-step turns go
    # as fresh requests, continuous episodes wait for a session to end)
    engine = build_engine(model_dir, EngineConfig(max_num_seqs=32), seed=0,
                          vllm_args=engine_args(EnvConfig(schedule="continuous")))
    rows = [{"prompt": f"{n}+{n}="} for n in range(16)]
    sampling = SamplingConfig(num_generations=4, max_tokens=8)
    result = {}
    for name in ("Chatter", "Tortoise"):
        turns = EnvConfig(name=f"tests/envs_for_tests.py:{name}", max_turns=3, max_episode_tokens=40, timeout_s=10.0)
        continuous = dataclasses.replace(turns, schedule="continuous")
        env_class = load_env(turns, ENVIRONMENTS_PY)

        def play(cfg: EnvConfig, seed: int, greedy: bool):
            return run_episodes(engine, tokenizer, env_class, rows, list(range(16)), sampling, cfg, seed, greedy)
        holds, Sessions.holds = Sessions.holds, lambda self, tokens: False
        plain = play(turns, 0, True)            # every turn a fresh request on the whole context
        Sessions.holds = holds
        sends.update(resumed=0, opened=0)
        lockstep = play(turns, 0, True)
        lockstep_resumed = sends["resumed"]
        sends.update(resumed=0, opened=0)
        free = play(continuous, 0, True)
        sampled, again, other = (play(continuous, seed, False) for seed in (1, 1, 2))
        continuous_sends = dict(sends)
        crowded = play(turns, 1, False)
        result[name] = {"greedy_same": same(plain, lockstep) and same(plain, free),
                        "turns": lockstep.episode["turns"].mean().item(),
                        "env_tokens": lockstep.episode["env_tokens"].sum().item(),
                        "sampled_again_same": same(sampled, again), "other_seed_same": same(sampled, other),
                        "sampled_turns": sampled.episode["turns"].mean().item(), "lockstep_resumed": lockstep_resumed,
                        "crowded_turns": crowded.episode["turns"].mean().item(),
                        "crowded_resumed": sends["resumed"] - continuous_sends["resumed"],
                        "tool_calls": sum(r.episode["tool_calls"].sum().item() for r in (free, sampled, again, other)),
                        **continuous_sends}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1]))
