"""A torchrun program (1 rank) for tests/test_agentic.py: episodes of test environments on the tiny model's real
engine, 16 prompts x 8 each, in one launch; prints, as one JSON line per environment, the actions it saw (when
it keeps them), the episodes' end reasons and returns, their tool calls, the sampled tokens that ran past a stop
string, each episode's text after its prompt (special tokens shown) and end reason, the end-of-turn tokens that
close a cut turn (observation tokens), the processes left running
that the environment marks as its own (`STRAY_SECONDS`), and the seconds it took. Every turn's steps run 16 at a time, each given up on 3 s after it started.

    torchrun --standalone --nproc_per_node 1 tests/episodes_check.py MODEL_DIR ENV [ENV ...]
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from forge_core.dist import Layout, init_roles, run_main
from forge_core.engine import EngineConfig, SamplingConfig, build_engine
from forge_core.env import END_REASONS, EnvConfig, load_env, run_episodes, stop_strings
from forge_core.model import ModelConfig, load_tokenizer, turn_end
from train_grpo import ENVIRONMENTS_PY


def strays(marker: str | None) -> int:
    """Processes on this machine whose command line holds `marker` (what an environment may leave behind)."""
    if marker is None:
        return 0
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            found += marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return found


def main(model_dir: str, env_names: list[str]) -> None:
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(ModelConfig(path=model_dir))
    engine = build_engine(model_dir, EngineConfig(), seed=0)
    rows = [{"prompt": f"{n}+{n}="} for n in range(16)]
    for name in env_names:
        # Spawner's calls fork this whole process (the engine's GBs): seconds each on a loaded 2-core machine
        cfg = EnvConfig(name=name, max_turns=2, timeout_s=30.0 if name.endswith(":Spawner") else 3.0, workers=16)
        env_class = load_env(cfg, ENVIRONMENTS_PY)
        start = time.perf_counter()
        rollout = run_episodes(engine, tokenizer, env_class, rows, list(range(16)),
                               SamplingConfig(num_generations=8, max_tokens=16), cfg, seed=0)
        seconds = time.perf_counter() - start
        sampled = rollout.completion_ids[rollout.model_mask.bool()].tolist()
        tokens = [tokenizer.decode([t], skip_special_tokens=True) for t in sampled]
        stops = stop_strings(env_class)
        texts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        ends = [next(r for r in END_REASONS if rollout.episode[f"end_{r}"][i]) for i in range(len(rollout))]
        print(json.dumps({"env": name, "actions": getattr(env_class, "actions", []), "seconds": seconds,
                          "strays": strays(getattr(env_class, "STRAY_SECONDS", None)),
                          "closed_cuts": int(((rollout.completion_ids == turn_end(tokenizer).ids[0])
                                              & (rollout.model_mask == 0) & rollout.completion_mask.bool()).sum()),
                          "end_reasons": {r: ends.count(r) for r in END_REASONS}, "texts": texts, "ends": ends,
                          "returns": rollout.episode["return"].tolist(),
                          "tool_calls": rollout.episode["tool_calls"].sum().item(),
                          "past_stop": [t for t in tokens if any(s in t and not t.endswith(s) for s in stops)]}),
              flush=True)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1], sys.argv[2:]))
