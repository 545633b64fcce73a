"""LoRA adapters (peft) on the HF model: added on the meta device before sharding, trained alone, merged on the way
out (export, the engines' sync).

The base weights stay frozen and are never copied: the reference policy is the same model with its adapter
switched off (`base_model`), the optimizer and the checkpoints hold only the adapter, and every weight an adapter
changes leaves as W + (alpha / rank) * B @ A, so the engines and the exported HF directory see plain weights.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .config import ForgeError

__all__ = ["LoRAConfig", "add_adapter", "init_adapter", "has_adapter", "base_model", "hf_name", "Adapted",
           "adapted_weights", "merge", "save_adapter", "local_shard"]

_PREFIX = "base_model.model."


@dataclass
class LoRAConfig:
    rank: int = 0                       # 0: no adapter, the whole model trains
    alpha: float = 16.0                 # the update is scaled by alpha / rank
    dropout: float = 0.0
    # module names (the last part of a path, as peft matches them) that get an adapter
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    save_adapter: bool = False          # also write the adapter alone (peft's directory) beside the merged export


def add_adapter(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """peft's LoRA on `model` (still on the meta device); a target name that matches no module is a config error
    (an adapter bound to nothing trains nothing)."""
    from peft import LoraConfig, get_peft_model
    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = [t for t in cfg.target_modules if t not in linear_names]
    if unmatched or not cfg.target_modules:
        raise ForgeError(f"config error: model.lora.target_modules {unmatched or []} match no linear layer of "
                         f"{type(model).__name__} (it has {sorted(linear_names)})")
    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def has_adapter(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


@torch.no_grad()
def init_adapter(model: nn.Module, seed: int) -> None:
    """peft's initialisation (A Kaiming-uniform, B zero: the adapted model starts as the base), drawn whole on every
    rank from one seed so that each rank keeps its own slice of the same tensors, whatever the sharding."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            full = torch.empty(param.shape)
            bound = 1 / math.sqrt(param.shape[1])      # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft draw
            full.uniform_(-bound, bound, generator=generator)
        elif ".lora_B." in name:
            full = torch.zeros(param.shape)
        else:
            continue
        local_shard(param).copy_(_slice_like(full.to(param.dtype), param))


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a (D)Tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _slice_like(full: Tensor, like: Tensor) -> Tensor:
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def base_model(model: nn.Module):
    """A context in which the model computes as its base (the reference policy); a plain model is its own base."""
    return model.disable_adapter() if has_adapter(model) else contextlib.nullcontext()


def hf_name(name: str) -> str:
    """The HF checkpoint's name of a (peft-wrapped) model's tensor."""
    return name.removeprefix(_PREFIX).replace(".base_layer.", ".")


@dataclass
class Adapted:
    """A base weight and the adapter on it: the merged weight is weight + scale * B @ A."""
    weight: Tensor
    a: Tensor                           # [rank, in]
    b: Tensor                           # [out, rank]
    scale: float


def adapted_weights(model: nn.Module) -> dict[str, Adapted]:
    """{HF name of each weight an adapter changes: its parts}; empty for a plain model."""
    if not has_adapter(model):
        return {}
    from peft.tuners.lora import LoraLayer
    adapted = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            adapted[hf_name(f"{name}.weight")] = Adapted(module.base_layer.weight, module.lora_A["default"].weight,
                                                         module.lora_B["default"].weight, module.scaling["default"])
    return adapted


def merge(weight: Tensor, a: Tensor, b: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """weight + scale * b @ a (full or row-sliced weight and b, whole a)."""
    return torch.addmm(weight, b, a, alpha=scale, out=out)


def save_adapter(model: nn.Module, adapter: dict[str, Tensor], out_dir) -> None:
    """peft's adapter directory (adapter_config.json + adapter_model.safetensors) from gathered adapter tensors."""
    from safetensors.torch import save_file
    config = model.peft_config["default"]
    config.save_pretrained(out_dir)
    save_file({k.replace(".default.", "."): v.contiguous() for k, v in adapter.items()},
              f"{out_dir}/adapter_model.safetensors", metadata={"format": "pt"})
