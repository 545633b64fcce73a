"""Multi-turn rollouts against single-turn generation: the turn loop's model tokens/s beside one single-turn
generate of the same tokens, on the calculator, the guessing game and TicTacToe self-play, in lock-step turns and
as continuous episodes (`env.schedule`; games play in rounds). One rank, one engine per job, the job's engine
settings (on CPU with unchunked prefills: continuous episodes need them, and both schedules and the peers share the
engine).

    python bench/bench_agent.py                          # about 2 minutes on 2 CPU cores
    python bench/bench_agent.py --env_delay_ms 50        # every environment step 50 ms slower (a slow tool)

- turn loop: `run_episodes` (or `play_games`) on the job's first train.prompts_per_step rows, G episodes each;
  model tokens over the rollout's wall time less the seconds the engine waited for environment calls (what
  train_grpo.py logs as perf/generate_tokens_per_s); medians over --repeats rollouts after one untimed.
- single-turn peer (same engine, right after each lock-step rollout): one request per episode on its first prompt,
  exactly as many tokens as the episode's model tokens (min_tokens = max_tokens, EOS ignored): the same tokens
  with the same length spread. `peer + observations`: the same after the episode's observation tokens, prefilled
  whole (all the tokens a turn loop must prefill, in one prompt: the bound a turn loop can reach). `fixed-length
  peer`: every sample the mean length (the spread's cost).
- engine steps: `llm_engine.step` calls per rollout (a lock-step turn lasts as long as its longest episode).
Models: each job's SFT model when its `make run-*` made one, else its untrained init (said in the table).
Target: the turn loop's tokens/s at least 0.8 of the single-turn peer's; the peer + observations is the bound
a turn loop can reach on the engine (its ratio column).
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time

from bench_grpo import REPO, last_json, run_checked, torchrun

JOBS = {"calculator": ("configs/grpo/tiny_calculator.yaml", "runs/sft-tiny-calculator/hf", "artifacts/tiny_calculator/init"),
        "guess": ("configs/grpo/tiny_guess.yaml", "runs/sft-tiny-guess/hf", "artifacts/tiny_guess/init"),
        "tictactoe": ("configs/grpo/tiny_tictactoe.yaml", "runs/sft-tiny-tictactoe/hf", "artifacts/tiny_tictactoe/init")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--repeats", type=int, default=5, help="timed rollouts per schedule")
    p.add_argument("--env_delay_ms", type=float, default=0.0, help="added to every environment step")
    p.add_argument("--config", default=None, help="with one job: its config instead of the default")
    p.add_argument("--model", default=None, help="with one job: its model instead of the default")
    p.add_argument("--worker", default=None, help="internal: the job this torchrun worker measures")
    return p.parse_args(argv)


class StepCounter:
    """Counts an engine's `llm_engine.step` calls."""

    def __init__(self, engine):
        self.engine, self.steps = engine.llm_engine, 0
        self.step = self.engine.step
        self.engine.step = self._counted

    def _counted(self):
        self.steps += 1
        return self.step()

    def take(self) -> int:
        steps, self.steps = self.steps, 0
        return steps


def peer_rate(engine, rollout, counter: StepCounter, fixed: bool = False, observations: bool = False) -> dict:
    """Single-turn generate of each sequence's model tokens from its first prompt (`fixed`: all the mean length;
    `observations`: the prompt followed by the episode's observation tokens, all the tokens a turn loop prefills)."""
    from vllm import SamplingParams
    env_tokens = [ids[(mask == 1) & (model == 0)].tolist() if observations else [] for ids, mask, model in
                  zip(rollout.completion_ids, rollout.completion_mask, rollout.model_mask)]
    played = [(ids[mask.bool()].tolist() + env, int(n)) for ids, mask, n, env in
              zip(rollout.prompt_ids, rollout.prompt_mask, rollout.model_mask.sum(dim=1), env_tokens)
              if n > 0]  # a seat that moved
    prompts, lengths = [{"prompt_token_ids": ids} for ids, _ in played], [n for _, n in played]
    if fixed:
        lengths = [round(sum(lengths) / len(lengths))] * len(lengths)
    # with observations, each prompt prefilled whole: a group's episodes share the prefix cache's blocks of their
    # prompt and observations here, which a turn loop's episodes, their own samples in between, do not
    params = [SamplingParams(n=1, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False,
                             skip_reading_prefix_cache=True if observations else None) for n in lengths]
    counter.take()
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, "steps": counter.take()}


def measure(config: str, model: str, repeats: int, env_delay_ms: float) -> dict:
    sys.path.insert(0, str(REPO))
    import torch
    from forge_core.config import load_config
    from forge_core.data import read_rows
    from forge_core.dist import Layout, init_roles
    from forge_core.engine import build_engine
    from forge_core.env import engine_args, load_env, run_episodes
    from forge_core.games import is_game, play_games
    from forge_core.model import load_tokenizer
    from train_grpo import ENVIRONMENTS_PY, GRPOConfig
    cfg = load_config(GRPOConfig, ["--config", config, "--model.path", model])
    init_roles(Layout(policy=1, reference=0, reward=0))
    tokenizer = load_tokenizer(cfg.model)
    env_class = load_env(cfg.env, ENVIRONMENTS_PY)
    game = is_game(env_class, cfg.env)
    if env_delay_ms:
        env_class.step = slowed(env_class.step, env_delay_ms / 1e3)
    engine = build_engine(model, cfg.engine, seed=0, vllm_args=engine_args(dataclasses.replace(cfg.env, schedule="continuous")))
    counter = StepCounter(engine)
    rows = read_rows(cfg.data.path)[:cfg.train.prompts_per_step]
    index = list(range(len(rows)))

    def rollout(schedule: str, seed: int):
        if game:
            players = env_class(**cfg.env.args).players
            return play_games({"policy": engine, "frozen": None}, tokenizer, env_class, rows, index, ["self"] * len(rows),
                              [i % players for i in index], cfg.sampling, cfg.env, cfg.game, seed)
        env_cfg = dataclasses.replace(cfg.env, schedule=schedule)
        return run_episodes(engine, tokenizer, env_class, rows, index, cfg.sampling, env_cfg, seed)

    figures: dict[str, list[dict]] = {}
    schedules = ["turns"] if game else ["turns", "continuous"]
    for repeat in range(repeats + 1):
        for schedule in schedules:
            counter.take()
            t0 = time.perf_counter()
            out = rollout(schedule, seed=repeat)
            wall = time.perf_counter() - t0
            tokens = out.model_mask.sum().item()
            waited = out.seconds.get("tools", 0.0)
            figures.setdefault(schedule, []).append(
                {"tokens_per_s": tokens / (wall - waited), "steps": counter.take(), "wall_s": wall,
                 "waited_s": waited, "env_calls_s": out.seconds.get("env_calls", waited),
                 "model_tokens": tokens / len(out), "turns": out.episode.get("turns", torch.zeros(1)).mean().item()})
            if schedule == "turns":
                figures.setdefault("peer", []).append(peer_rate(engine, out, counter))
                figures.setdefault("prefill", []).append(peer_rate(engine, out, counter, observations=True))
                figures.setdefault("fixed", []).append(peer_rate(engine, out, counter, fixed=True))
    return {name: {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]} for name, runs in figures.items()}


def slowed(step, seconds: float):
    def step_later(self, action):
        time.sleep(seconds)
        return step(self, action)
    return step_later


def report(results: dict[str, dict], delay_ms: float) -> str:
    lines = [f"environment steps {delay_ms:g} ms slower" if delay_ms else "environments as they are",
             "| job (model) | rollout | model tokens/s | ratio to peer | ratio to peer + observations | engine steps | "
             "turns | model tokens per episode | wall (s) | waited on env / env calls (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for job, (model, r) in results.items():
        peer, bound = r["peer"]["tokens_per_s"], r["prefill"]["tokens_per_s"]
        for name in ("turns", "continuous", "peer", "prefill", "fixed"):
            if name not in r:
                continue
            f = r[name]
            label = {"turns": "turn loop, lock-step", "continuous": "turn loop, continuous",
                     "peer": "single-turn peer", "prefill": "peer + observations",
                     "fixed": "fixed-length peer"}[name]
            ratio = f["tokens_per_s"] / peer
            mark = f" ({'>=' if ratio >= 0.8 else '<'} 0.8)" if name in ("turns", "continuous") else ""
            extra = (f"{f['turns']:.2f} | {f['model_tokens']:.1f} | {f['wall_s']:.3f} | {f['waited_s']:.3f} / "
                     f"{f['env_calls_s']:.3f}" if "turns" in f else " | | | ")
            lines.append(f"| {job} ({model}) | {label} | {f['tokens_per_s']:.0f} | {ratio:.3f}{mark} | "
                         f"{f['tokens_per_s'] / bound:.3f} | {f['steps']:.0f} | {extra} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        from forge_core.dist import run_main
        run_main(lambda: print(json.dumps(measure(args.config, args.model, args.repeats, args.env_delay_ms))))
        return
    if (args.config or args.model) and len(args.jobs) > 1:
        sys.exit("bench error: --config and --model are for one job (--jobs NAME)")
    results = {}
    for job in args.jobs:
        config, trained, init = JOBS[job]
        model = args.model or (trained if (REPO / trained / "config.json").is_file() else init)
        if not (REPO / model / "config.json").is_file():
            sys.exit(f"bench error: no model at {model}: run `make {init}/config.json` (or its make run-*) first")
        out, _ = run_checked(torchrun(1, __file__, "--worker", job, "--config", args.config or config, "--model",
                                      model, "--repeats", str(args.repeats), "--env_delay_ms", str(args.env_delay_ms)))
        results[job] = ("SFT" if model == trained else "given" if args.model else "untrained", last_json(out))
    print(report(results, args.env_delay_ms))
    print("raw numbers: " + json.dumps(results))


if __name__ == "__main__":
    main()
