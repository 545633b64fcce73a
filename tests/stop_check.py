"""A torchrun program (1 rank) for tests/test_agentic.py: episodes on the tiny model's real engine whose stop
string, `st`, falls inside tokens of the tiny tokenizer (`sta`, `start`, `assistant`), as `</python>` falls inside
SmolLM2's `><`. vLLM ends such a turn at the stop string and keeps the token; prints, as JSON, the actions the
environment saw and the sampled tokens that ran past the stop string.

    torchrun --standalone --nproc_per_node 1 tests/stop_check.py MODEL_DIR
"""

import json
import sys

from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine
from forge_core.env import EnvConfig, run_episodes
from forge_core.model import ModelConfig, load_tokenizer

STOP = "st"


class StopAtST:
    stop = [STOP]
    actions: list[str] = []         # every instance's, in order

    def reset(self, row: dict) -> str:
        return row["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        StopAtST.actions.append(action)
        return "ok", 0.0, False


def main(model_dir: str) -> None:
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    engine = build_engine(model_dir, EngineConfig(), seed=0)
    rows = [{"prompt": f"{n}+{n}="} for n in range(16)]
    rollout = run_episodes(engine, tokenizer, StopAtST, rows, list(range(16)),
                           SamplingConfig(num_generations=8, max_tokens=16), EnvConfig(max_turns=2), seed=0)
    sampled = rollout.completion_ids[rollout.model_mask.bool()].tolist()
    tokens = [tokenizer.decode([t], skip_special_tokens=True) for t in sampled]
    print(json.dumps({"actions": StopAtST.actions, "tool_calls": rollout.episode["tool_calls"].sum().item(),
                      "past_stop": [t for t in tokens if STOP in t and not t.endswith(STOP)]}))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1]))
