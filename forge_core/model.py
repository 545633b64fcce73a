"""Hugging Face models and tokenizers: their configs, the template's end of turn, FSDP2 sharding, CPU GEMM kernels.

`shard(model, mesh, fsdp_cfg)` applies activation checkpointing (and offload) and `fully_shard` per decoder layer,
then the root (torchtitan's order); `weights.build_model` calls it on the meta device. The HF model class is used
as is.
"""

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import NonNegativeFloat, PositiveInt
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .config import ForgeError
from .lora import LoRAConfig
from .tensor_parallel import parallelize

__all__ = ["ModelConfig", "FSDPConfig", "TurnEnd", "turn_end", "local_dir", "model_config", "load_tokenizer", "shard",
           "linear_kernel", "cpu_has_bf16", "cpu_prefers_bf16", "bf16_chosen", "use_onednn_linears", "onednn_linear",
           "set_gradient_sync"]


@dataclass
class ModelConfig:
    path: str = "artifacts/tiny/sft"    # local HF directory (safetensors) or a hub id
    lora: LoRAConfig = field(default_factory=LoRAConfig)     # rank > 0: train a LoRA adapter, not the model
    trust_remote_code: bool = False     # never run code shipped with a checkpoint unless asked to
    # flex_attention (GPU only: no CPU backward): GRPO's shared-prompt rows as a block mask, whose kernel skips
    # what a completion cannot see; sdpa computes every pair under a dense mask (L^2 booleans per row). At
    # Qwen3-1.7B's micro-batch on an H200 the block mask was 4% faster, on a CPU the dense mask costs ~4%
    # (docs/benchmarks.md); its share grows with the completions' length
    attention: Literal["sdpa", "flex_attention"] = "sdpa"
    # Mixture-of-Experts: the weight of the routers' load-balancing loss (forge_core/moe.py); 0 = off, as
    # transformers' own default (output_router_logits false); Qwen3-MoE's checkpoints name 0.001
    router_aux_loss: NonNegativeFloat = 0.0


@dataclass
class FSDPConfig:
    # auto: bf16 params on GPU, fp32 on CPU; bf16_if_native: bf16 on GPU and on CPUs with AMX (cpu_prefers_bf16:
    # the SmolLM2 GRPO step 1.8x faster on an AMX Xeon, 1.4x slower on one with AVX512-BF16 alone), fp32 elsewhere
    mixed_precision: Literal["auto", "fp32", "bf16", "bf16_if_native"] = "auto"
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True     # sharded ranks only: replicated ones (shard: false) keep their weights
    # false: every rank keeps the whole model, its gradients and Adam's state (DDP), and the gradients are
    # all-reduced once per optimizer step, instead of FSDP's all-gathers per layer and micro-batch and its
    # reduce-scatter: faster on CPU for a model whose training state fits each rank (the SmolLM2 GRPO train
    # phase 12% faster in fp32 on a Xeon, 24% with train_grpo's balanced deal; docs/design.md)
    shard: bool = True
    # CPU, fp32: the GEMMs of every nn.Linear. auto = oneDNN on AMD (2.3x torch's MKL on a Zen 5, equal on Zen 1/3),
    # torch's own on Intel (MKL's fast paths; oneDNN was 0.8-1.05x of it on AVX-512 Xeons): bench/bench_gemm.py
    linear_kernel: Literal["auto", "onednn", "torch"] = "auto"
    # ranks that split each decoder layer's heads and MLP width (forge_core/tensor_parallel.py), inside a node;
    # FSDP shards over the data-parallel rest. GRPO: blocks of policy ranks (dividing the engines'), and of
    # reference ranks where their number is a multiple of it
    tensor_parallel_size: PositiveInt = 1
    # host memory for what does not fit the GPU (README "Models bigger than one process"): FSDP2's CPUOffloadPolicy keeps parameters,
    # gradients and Adam's state on the host (the optimizer steps there); activation_offload keeps each decoder
    # layer's saved activations there until backward
    cpu_offload: bool = False
    activation_offload: bool = False


def _resolve(path: str) -> str:
    """A local directory as is; otherwise a hub id (org/name); anything else is a clear error."""
    if Path(path).is_dir():
        return path
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/")) and not Path(path).exists()
    if not looks_like_hub_id:
        raise ForgeError(f"model error: model.path '{path}': no such directory")
    return path


def local_dir(path: str) -> str:
    """The local directory of a model: as is, or a hub id's download (its config, tokenizer and safetensors)."""
    path = _resolve(path)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download
    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])


def model_config(cfg: ModelConfig):
    """The model's transformers config (its config.json): what the checks made before any weights load read."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer, once the model's directory is known to hold what a run needs, before any weights
    load: safetensors weights, a tokenizer, and its chat template (every prompt is formatted with it)."""
    from transformers import AutoTokenizer
    path = _resolve(cfg.path)
    if Path(path).is_dir() and not any(Path(path).glob("*.safetensors")):
        raise ForgeError(f"model error: model.path '{cfg.path}': no weights (*.safetensors)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())         # transformers' reasons run over several lines
        raise ForgeError(f"model error: model.path '{cfg.path}': cannot load a tokenizer ({reason})") from None
    if tokenizer.chat_template is None:
        raise ForgeError(f"model error: model.path '{cfg.path}': the tokenizer has no chat template "
                         "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    return tokenizer


@dataclass(frozen=True)
class TurnEnd:
    """How the chat template ends an assistant message: its text (`<|im_end|>`, Llama-3's `<|eot_id|>`, Gemma's
    `<end_of_turn>`) and the token ids at which a model turn ends: that token, and EOS."""
    text: str
    ids: tuple[int, ...]


def turn_end(tokenizer) -> TurnEnd:
    """Read from the template itself: what it writes right after an assistant message's content, when that is
    one of the tokenizer's added tokens (else EOS alone, as for a template with no end-of-turn token)."""
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    after = tokenizer(rendered[rendered.rindex("!") + 1:], add_special_tokens=False).input_ids
    eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    if after and after[0] in tokenizer.added_tokens_decoder:
        return TurnEnd(tokenizer.added_tokens_decoder[after[0]].content, tuple(dict.fromkeys((after[0], *eos))))
    return TurnEnd(tokenizer.eos_token, eos)


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model: itself, or the one a peft model wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(hf_model(model), "model", None), "layers", None)
    assert isinstance(layers, nn.ModuleList), f"{type(model).__name__} has no model.layers ModuleList"
    return layers


def shard(model: nn.Module, mesh: DeviceMesh, cfg: FSDPConfig) -> nn.Module:
    """oneDNN linears on CPU (optional), activation checkpointing (optional), then fully_shard each decoder
    layer and the root. With `cfg.shard` false each rank keeps the whole model: it is "sharded" over a mesh of
    this rank alone (FSDP's bf16 casting, no collectives) and `optim.optimizer_step` all-reduces the gradients over
    `mesh`'s ranks, its `replica_group`."""
    if not cfg.shard and mesh.size() > 1:
        alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        # over one rank an all-gather is a copy: backward reuses forward's bf16 weights (SmolLM2 GRPO train -9%, Xeon)
        model = shard(model, DeviceMesh.from_group(alone, mesh.device_type), replace(cfg, reshard_after_forward=False))
        model.replica_group = mesh.get_group()
        return model
    if mesh.ndim == 2:      # tensor parallelism inside each block of the mesh's "tp" dimension, then FSDP over "dp"
        parallelize(model, mesh["tp"])
        mesh = mesh["dp"]
    elif mesh.device_type == "cpu" and linear_kernel(cfg) == "onednn":   # its GEMMs take no DTensors
        use_onednn_linears(model)
    bf16 = bf16_chosen(cfg.mixed_precision, mesh.device_type == "cuda")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    if cfg.activation_checkpointing:    # HF's own hook keeps parameter names (checkpoint_wrapper renames them)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.activation_offload:
        _offload_activations(layers)
    if mesh.size() == 1 and not bf16 and not cfg.cpu_offload:   # one rank, fp32: FSDP would only add copies (~10%)
        return model if _on_meta(model) else model.to(mesh.device_type)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=cfg.reshard_after_forward)
    # the root is the HF model, also inside a peft model: its generate() calls the HF model, not the wrapper
    fully_shard(hf_model(model), mesh=mesh, mp_policy=policy, offload_policy=offload,
                reshard_after_forward=cfg.reshard_after_forward)
    return model


def _on_meta(model: nn.Module) -> bool:
    return next(model.parameters()).is_meta


def _offload_activations(layers: nn.ModuleList) -> None:
    """Each decoder layer keeps the tensors its backward needs in host memory (pinned on GPU) until backward
    brings them back (`torch.autograd.graph.save_on_cpu`): device memory for activations falls to about a
    layer's worth, paid for with two host transfers of them per step."""
    for layer in layers:
        layer.forward = functools.partial(_saved_on_host, layer.forward)


def _saved_on_host(forward, *args, **kwargs):
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return forward(*args, **kwargs)


def _cpuinfo() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.read_text() if cpuinfo.exists() else ""


def linear_kernel(cfg: FSDPConfig) -> str:
    """The CPU GEMM kernel `cfg.linear_kernel` names; auto decides by the CPU (oneDNN on AMD with AVX-512, where
    MKL keeps to its AVX2 code; torch's MKL elsewhere), so every run on a machine (a resumed one too) multiplies
    the same way."""
    if cfg.linear_kernel != "auto":
        return cfg.linear_kernel
    return "onednn" if "AuthenticAMD" in _cpuinfo() and "avx512f" in _cpu_flags() else "torch"


def _cpu_flags() -> set[str]:
    return set(next((line.split(":", 1)[1].split() for line in _cpuinfo().splitlines()
                     if line.startswith("flags")), []))


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AMX or AVX512-BF16: dot products, conversions that round); others
    convert to fp32 in software."""
    return bool(_cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_prefers_bf16() -> bool:
    """Whether this CPU multiplies bf16 faster than fp32: with AMX's tiles (bf16 GEMMs ~6x fp32's on a Xeon).
    AVX512-BF16's dot products alone are not enough: on a Xeon whose VM hides AMX, torch's bf16 GEMMs ran at half
    its fp32 rate and the SmolLM2 GRPO step was 1.4x slower in bf16 (Zen 4/5 unmeasured: fp32 there)."""
    return "amx_bf16" in _cpu_flags()


def bf16_chosen(setting: str, on_gpu: bool) -> bool:
    """A precision setting (fsdp.mixed_precision, engine.dtype) resolved on this machine: bf16 or not. Decided by
    the CPU's flags, not a start-up timing, so a run and its resume on one machine compute alike."""
    return setting == "bf16" or (setting in ("auto", "bf16_if_native") and on_gpu) or \
        (setting == "bf16_if_native" and cpu_prefers_bf16())


class _OneDNNLinearFn(torch.autograd.Function):
    """y = x W^T + b with forward and backward GEMMs in oneDNN. torch's fp32 CPU matmul goes to MKL, which
    takes its AVX2 path on AMD processors; oneDNN uses AVX-512 there (measured 2.3x on a Zen 5). On AVX2-only
    CPUs MKL is the faster (a Zen 3's GRPO train phase: 1.5x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])                          # [N, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad_out, weight.t(), None)                          # [..., in]
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad_2d, x.reshape(-1, x.shape[-1]))                  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad^T x for grad [N, out] and x [N, in]. oneDNN copies its left operand into transposed order first:
    the narrower of the two goes there (for an up-projection that is x, a quarter of grad's bytes)."""
    if grad.shape[1] > x.shape[1]:
        return onednn_linear(x.t(), grad.t(), None).t()
    return onednn_linear(grad.t(), x.t(), None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias in oneDNN, from the weight as it is (no packed copy); no autograd."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:   # bf16 mixed precision: torch's own
            return super().forward(x)
        return _OneDNNLinearFn.apply(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> None:
    """Swap the class of every nn.Linear for one whose GEMMs run in oneDNN; names and weights stay as they are."""
    if not torch.backends.mkldnn.is_available():
        return
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = _OneDNNLinear


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Gradient accumulation: reduce-scatter only on the last micro-batch (a no-op for an unsharded model)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
