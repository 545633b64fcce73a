"""Every shipped config loads: no unknown keys, every value of the right type."""

from pathlib import Path

import pytest

from forge_core.config import ForgeError, load_config
from train_grpo import GRPOConfig
from train_sft import SFTConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted((CONFIGS / "sft").glob("*.yaml")), ids=lambda p: p.name)
def test_sft_configs_load(path):
    cfg = load_config(SFTConfig, ["--config", str(path)])
    assert cfg.train.batch_size % cfg.train.micro_batch_size == 0


@pytest.mark.parametrize("path", sorted((CONFIGS / "grpo").glob("*.yaml")), ids=lambda p: p.name)
def test_grpo_configs_load(path):
    cfg = load_config(GRPOConfig, ["--config", str(path)])
    assert cfg.layout.policy % cfg.engine.tensor_parallel_size == 0
    assert cfg.train.prompts_per_step % cfg.layout.policy == 0
    assert cfg.loss.beta == 0 or cfg.layout.reference > 0


def test_overrides_win_over_the_yaml():
    cfg = load_config(SFTConfig, ["--config", str(CONFIGS / "sft" / "tiny.yaml"), "--optim.lr", "0.5"])
    assert cfg.optim.lr == 0.5 and cfg.train.steps > 0


def test_wrong_literal_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss:\n  loss_type: ppo\n")
    with pytest.raises(ForgeError, match=r"'loss.loss_type' expects one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', got 'ppo'"):
        load_config(GRPOConfig, ["--config", str(bad)])
