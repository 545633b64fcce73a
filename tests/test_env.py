"""Multi-turn pieces without an engine: observation tokens carry no loss, the calculator never evaluates code,
an observation is appended inline or as the template's next message, and a bad environment (its name, or
resets that all fail) is a one-line error."""

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from environments import Calculator, GuessNumber, PythonTool, calculate
from forge_core.config import ForgeError
from forge_core.engine import SamplingConfig
from forge_core.env import EnvConfig, observation_ids, load_env, run_episodes
from forge_core.model import turn_end
from forge_core.rollout import Rollout
from train_grpo import ENVIRONMENTS_PY, LossConfig, grpo_loss, loss_scale


def _episode_rollout(logp_env: float, sampler_env: float, ref_env: float) -> tuple[Rollout, torch.Tensor]:
    """Two episodes of 4 tokens; token 1 and 2 of the first and token 3 of the second are an observation's."""
    model_mask = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 0]])
    on_env = model_mask == 0
    logp = torch.tensor([[-0.3, 0.0, 0.0, -0.9], [-0.2, -1.1, -0.4, 0.0]]).masked_fill(on_env, logp_env)
    rollout = Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                      torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                      torch.full((2, 4), -0.5).masked_fill(on_env, sampler_env), torch.zeros(2, dtype=torch.bool),
                      [0, 0], ref_logprobs=torch.full((2, 4), -0.6).masked_fill(on_env, ref_env),
                      advantages=torch.tensor([1.0, -1.0]), model_mask=model_mask)
    return rollout, logp.requires_grad_()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_observation_tokens_carry_no_loss_kl_or_importance_weight(loss_type):
    cfg = LossConfig(loss_type=loss_type, beta=0.1, importance_sampling_cap=3.0)
    losses, grads = [], []
    for env_values in [(-1.0, -2.0, -3.0), (-7.0, -0.1, -20.0)]:   # observation logprobs of any value
        rollout, logp = _episode_rollout(*env_values)
        loss, _ = grpo_loss(logp, rollout, cfg, loss_scale(rollout, 4, None, 1))
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad)
        assert (logp.grad[rollout.model_mask == 0] == 0).all()
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    torch.testing.assert_close(grads[0], grads[1])
    assert rollout.loss_mask().sum() == 5          # the normalisers count the model's 5 tokens, not all 8


def test_calculator_parses_and_never_evaluates():
    assert calculate("37*48") == "1776" and calculate("(2+3)**2 - 7/2") == "21.5" and calculate("-4//3") == "-2"
    for bad, why in [("__import__('os').system('id')", "only numbers"), ("9**9**9", "exponent too large"),
                     ("1/0", "division by zero"), ("1+" * 60 + "1", "too long"), ("2*", "not an arithmetic"),
                     ("10**15*1000", "number too large")]:
        with pytest.raises(ValueError, match=why):
            calculate(bad)


def test_calculator_environment_turns():
    env = Calculator()
    assert env.reset({"prompt": "37*48=", "answer": "1776"}) == "37*48="
    assert env.step("<calc>37*48</calc>") == ("<result>1776</result>", 0.0, False)
    assert env.step("<calc>37*</calc>") == ("<result>error: not an arithmetic expression</result>", 0.0, False)
    assert env.tool_errors == 1
    assert env.step("1776") == ("", 1.0, True)
    assert Calculator().reset({"prompt": "p", "answer": 5}) and Calculator.stop == ["</calc>"]


def test_guess_number_rewards_fewer_guesses():
    env = GuessNumber()
    env.reset({"prompt": "Guess (1-32)", "answer": "20"})
    assert env.step("16") == ("higher", 0.0, False)
    assert env.step("x") == ("a number, please", 0.0, False)
    assert env.step("20") == ("", pytest.approx(0.9 ** 2), True)


def test_python_tool_runs_model_code_in_the_sandbox():
    env = PythonTool()
    assert env.reset({"question": "What is 12*7?", "answer": "12*7 = <<12*7=84>>84\n#### 84"}).endswith("12*7?")
    assert env.step("Let me compute.<python>print(12*7)</python>") == ("<output>84</output>", 0.0, False)
    observation, _, done = env.step("<python>import socket; socket.create_connection(('127.0.0.1', 22))</python>")
    assert "Network is unreachable" in observation and "exit code 1" in observation and not done
    assert env.step("It is 84.\n#### 84") == ("", 1.0, True) and env.tool_errors == 1 and env.tool_timeouts == 0


def test_observation_is_inline_or_the_templates_next_message(tiny):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny / "init")
    inline = observation_ids(tokenizer, "<result>42</result>", ending="tool", role="user", max_tokens=32,
                              end_text=turn_end(tokenizer).text)
    assert tokenizer.decode(inline) == "<result>42</result>"
    message = observation_ids(tokenizer, "higher", ending="end", role="user", max_tokens=32,
                              end_text=turn_end(tokenizer).text)
    assert tokenizer.decode(message) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    cut = observation_ids(tokenizer, "123456789", ending="tool", role="user", max_tokens=4,
                          end_text=turn_end(tokenizer).text)
    assert tokenizer.decode(cut) == "1234"
    after_a_cut = observation_ids(tokenizer, "higher", ending="cut", role="user", max_tokens=32,
                                  end_text=turn_end(tokenizer).text)
    assert tokenizer.decode(after_a_cut) == "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                   "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                   "\n\n{% endif %}")
GEMMA_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                  "{% endif %}")


@pytest.mark.parametrize("template, special, end, header", [
    (LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>",
     "<|start_header_id|>user<|end_header_id|>\n\nhigher<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    (GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
     "\n<start_of_turn>user\nhigher<end_of_turn>\n<start_of_turn>model\n"),
])
def test_a_turn_ends_where_the_template_ends_it_when_that_is_not_eos(tiny, template, special, end, header):
    """Llama-3 ends a turn with <|eot_id|> and Gemma with <end_of_turn>, and EOS is another token (Llama-3's
    <|end_of_text|>): the engine stops at either, and an observation after the turn's end is the template's next
    message (looking EOS up in the rendered template raised ValueError, outside any handler)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny / "init")
    tokenizer.add_special_tokens({"eos_token": "<|end_of_text|>", "additional_special_tokens": special})
    tokenizer.chat_template = template
    found = turn_end(tokenizer)
    assert found.text == end and found.ids == tuple(tokenizer.convert_tokens_to_ids([end, "<|end_of_text|>"]))
    message = observation_ids(tokenizer, "higher", ending="end", role="user", max_tokens=32, end_text=found.text)
    assert tokenizer.decode(message) == header


def test_an_environment_whose_every_reset_fails_is_one_line():
    """Nothing to play (resets come before the engine is used): the run ends with one line, not empty rollouts."""
    env_class = load_env(EnvConfig(name="tests/envs_for_tests.py:Unreliable"), ENVIRONMENTS_PY)
    with pytest.raises(ForgeError, match=r"^env error: every Unreliable.reset of a batch failed \(why: the line"):
        run_episodes(None, None, env_class, [{"prompt": "1+1="}] * 2, [0, 1], SamplingConfig(), EnvConfig(), seed=0)


def test_an_environment_that_calls_sys_exit_fails_its_call_at_once(capsys):
    """sys.exit() in a reset is that call's failure, said as such, not a hang until env.timeout_s (it would
    end only the call's thread) nor the end of the rank."""
    env_class = load_env(EnvConfig(name="tests/envs_for_tests.py:Exits"), ENVIRONMENTS_PY)
    start = time.monotonic()
    with pytest.raises(ForgeError, match=r"^env error: every Exits.reset of a batch failed"):
        run_episodes(None, None, env_class, [{"prompt": "1+1="}] * 2, [0, 1], SamplingConfig(), EnvConfig(), seed=0)
    assert time.monotonic() - start < 10
    assert "env: Exits.reset raised SystemExit: 3; such episodes end as env_error" in capsys.readouterr().err


def test_a_hung_call_costs_its_own_answer_and_its_thread_only():
    """CallPool: with one worker, a call that hangs answers None after timeout_s and a new thread runs the calls
    queued behind it; a call still waiting twice timeout_s after it was asked for is not run."""
    from forge_core.calls import CallPool
    pool, ran = CallPool(workers=1, timeout_s=0.3), []

    def call(seconds: float, name: str) -> str:
        time.sleep(seconds)
        ran.append(name)
        return name
    for seconds, name in ((5.0, "hangs"), (0.0, "behind"), (0.0, "also behind")):
        pool.ask(name, call, seconds, name)
    answers = {}
    while pool.pending():
        answers |= dict(pool.answers(wait=True))
    assert answers == {"hangs": None, "behind": "behind", "also behind": "also behind"} and pool.late == 1
    assert ran == ["behind", "also behind"] and 0.25 < pool.busy_s < 1.0, pool.busy_s
    late = CallPool(workers=1, timeout_s=0.2)
    for name in ("a", "b", "c"):
        late.ask(name, call, 0.15, name)        # c waits 0.3 s, under 2 * timeout_s: it runs
    late.ask("d", call, 5.0, "d")               # hangs 0.2 s, so e has waited 0.65 s > 0.4 s: not run
    late.ask("e", call, 0.0, "e")
    answers = {}
    while late.pending():
        answers |= dict(late.answers(wait=True))
    assert answers == {"a": "a", "b": "b", "c": "c", "d": None, "e": None} and late.late == 2


def test_a_bad_environment_name_is_one_line():
    with pytest.raises(ForgeError, match=r"config error: env.name: no 'Maze' in /.*/environments.py"):
        load_env(EnvConfig(name="Maze"), ENVIRONMENTS_PY)
    with pytest.raises(ForgeError, match=r"config error: env.name: cannot import 'no_such_file.py'"):
        load_env(EnvConfig(name="no_such_file.py:Maze"), ENVIRONMENTS_PY)
    with pytest.raises(ForgeError, match=r"config error: env.name: tests/envs_for_tests.py:NoStep has no step method"):
        load_env(EnvConfig(name="tests/envs_for_tests.py:NoStep"), ENVIRONMENTS_PY)
    assert load_env(EnvConfig(), ENVIRONMENTS_PY) is None
    assert load_env(EnvConfig(name="Calculator"), ENVIRONMENTS_PY) is Calculator


def test_forge_core_finds_bare_names_in_the_files_a_script_passes_without_the_repository_on_sys_path(tmp_path):
    """pyproject installs forge_core alone: bare names (`addition_correct`, `Calculator`) are looked up in the
    file the script passes (its neighbour), not in a top-level module found on sys.path."""
    (tmp_path / "forge_core").symlink_to(REPO / "forge_core")
    code = f"""
import sys
sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})]
from types import SimpleNamespace
from forge_core.env import EnvConfig, load_env
from forge_core.scoring import load_reward_functions
cfg = SimpleNamespace(functions=["addition_correct"], weights=None)
fn = load_reward_functions(cfg, {str(REPO / "rewards.py")!r})["addition_correct"]
env = load_env(EnvConfig(name="Unreliable"), {str(REPO / "tests" / "envs_for_tests.py")!r})
print(fn(" 579", {{"answer": 579}}), env.__name__, "rewards" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1.0", "Unreliable", "True"]
