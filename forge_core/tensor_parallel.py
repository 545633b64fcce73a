"""Tensor parallelism in training: `fsdp.tensor_parallel_size` ranks split each decoder layer's attention heads and
MLP width (Megatron's layout), FSDP2 shards over the data-parallel ranks, the 2-D mesh ("dp", "tp") with each
tensor-parallel block of consecutive ranks, inside a node, where the per-layer collectives are cheap.

The plan is torchtitan's, by the HF module names: q/k/v and gate/up `ColwiseParallel`, o/down `RowwiseParallel` (a
reduce-scatter after each), the embedding `RowwiseParallel` over the vocabulary, the head `ColwiseParallel` with its
logits left split over the vocabulary inside `vocab_parallel` (loss parallel: the loss code's `chosen_logprobs` joins
each row's softmax by all-reduces of [rows] numbers, so no rank holds whole logits) and gathered whole outside it (HF
generate), Qwen3's per-head q/k norms as replicated parameters over the local heads (their gradients then sum over
the ranks: left as plain tensors each rank's held only its heads'), and sequence parallelism between the layers
(`parallelize`). TP is applied before FSDP (torchtitan's order). A Mixture-of-Experts model's experts and routers
stay whole on each tensor-parallel rank and are FSDP-sharded over dp only.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from .config import ForgeError

__all__ = ["training_mesh", "check_tensor_parallel", "parallelize", "vocab_parallel", "flat_group"]

SEQUENCE = Shard(1)         # the residual stream between the layers: each rank holds its share of the positions


def training_mesh(ranks: list[int], device_type: str, tp: int) -> DeviceMesh:
    """The mesh a model trains on: 1-D over `ranks` (FSDP), or 2-D ("dp", "tp") with blocks of `tp` consecutive
    ranks."""
    if tp == 1:
        return DeviceMesh(device_type, ranks)
    return DeviceMesh(device_type, torch.tensor(ranks).view(-1, tp), mesh_dim_names=("dp", "tp"))


def check_tensor_parallel(tp: int, shard: bool, lora: bool, model_config) -> None:
    """A tensor-parallel size that does not split the model's heads or MLP is a config error (one that does not
    divide the ranks or a node is `init_dist`'s), and so is one with replicated ranks or a LoRA adapter (peft's
    layers wrap the linears the plan names)."""
    if tp == 1:
        return
    name = "fsdp.tensor_parallel_size"
    if not shard:
        raise ForgeError(f"config error: {name}={tp} needs fsdp.shard true (tensor parallelism shards each layer)")
    if lora:
        raise ForgeError(f"config error: {name}={tp} with model.lora.rank: LoRA trains without tensor parallelism")
    config = model_config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = {"attention heads": heads, "key/value heads": kv_heads, "MLP width (intermediate_size)":
              config.intermediate_size}
    for what, n in widths.items():
        if n % tp:
            raise ForgeError(f"config error: {name}={tp} does not split the model's {n} {what} evenly")


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply the plan to the HF model (a causal LM with `model.layers`) over the tensor-parallel `mesh`.

    Sequence parallelism between the layers: the residual stream is split over the sequence (`Shard(1)`), each
    layer's norms run on their rank's positions, attention and the MLP gather the whole sequence at their input and
    their output projections reduce-scatter it back (the same bytes as TP's all-reduce, activations at 1/tp). The
    embedding's output stays whole, so HF's model computes its masks and rotary angles from the whole sequence; the
    first layer cuts it, and the final norm gathers it again (HF picks the logits' positions from its output)."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = hf.model.layers
    parallelize_module(hf.model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "norm": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                                   use_local_output=True)})
    parallelize_module(layers[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(SEQUENCE,)))
    for layer in layers:
        parallelize_module(layer, mesh, _layer_plan(layer))
    parallelize_module(hf, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    hf.lm_head.register_forward_hook(_whole_unless_vocab_parallel)
    if hf.config.get_text_config().tie_word_embeddings:     # both split the vocabulary: one tensor again
        hf.lm_head.weight = hf.model.embed_tokens.weight


def _layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQUENCE},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=SEQUENCE,
                                                                                        use_local_output=False)}
    if hasattr(layer.self_attn, "q_norm"):      # Qwen3: normalizes each head, over this rank's heads
        norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan |= {"self_attn.q_norm": norm, "self_attn.k_norm": norm}
    if hasattr(layer.mlp, "experts"):           # experts and router whole on each rank: all positions, then its own
        return plan | {"mlp": PrepareModuleInputOutput(
            input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(SEQUENCE,), use_local_output=False)}
    return plan | {"mlp": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),)),
                   "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                   "mlp.down_proj": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False)}


_split_logits = False


@contextmanager
def vocab_parallel():
    """Within: a tensor-parallel head's logits stay DTensors split over the vocabulary (for `chosen_logprobs`);
    outside they are gathered whole. No effect on a model without tensor parallelism."""
    global _split_logits
    _split_logits = True
    try:
        yield
    finally:
        _split_logits = False


def _whole_unless_vocab_parallel(module: nn.Module, args, output):
    return output if _split_logits else output.full_tensor()


def flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of all of a (1-D or 2-D) mesh's ranks."""
    return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
