"""A model's weights in and out of HF safetensors directories with no whole copy on any rank.

`build_model` makes the HF model class on the meta device (adds a LoRA adapter), shards it (`model.shard`), gives
memory to this rank's shards only, and fills them from the safetensors files with DCP's HuggingFaceStorageReader:
each rank reads just its own slices (torchtitan's way). A full load made every rank hold the whole model in fp32
first (bench/bench_load.py measures both).

`export_hf` gathers one tensor at a time (merging an adapter into its weight) and the group's first rank writes
them into safetensors files of at most `shard_bytes` each, freed as each is written. A Mixture-of-Experts model's
fused experts are read and written one tensor per expert, as checkpoints hold them (forge_core/moe.py).
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .ckpt import first_on_any_rank, publish_dir
from .config import ForgeError
from .lora import add_adapter, adapted_weights, has_adapter, hf_name, init_adapter, merge, save_adapter
from .model import FSDPConfig, ModelConfig, hf_model, local_dir, shard
from .moe import checkpoint_tensors, is_fused_experts, local_experts
from .tensor_parallel import check_tensor_parallel, flat_group

__all__ = ["build_model", "hf_tensors", "export_hf", "full_tensor"]


def build_model(cfg: ModelConfig, mesh: DeviceMesh, fsdp: FSDPConfig, seed: int = 0) -> nn.Module:
    """Collective over `mesh`: the model sharded over it with the weights of `cfg.path` (and, `cfg.lora.rank` > 0,
    a fresh adapter drawn from `seed`)."""
    model = _empty_model(cfg)
    check_tensor_parallel(fsdp.tensor_parallel_size, fsdp.shard, bool(cfg.lora.rank), model.config)
    if cfg.lora.rank:
        model = add_adapter(model, cfg.lora)
    model = shard(model, mesh, fsdp)
    model.to_empty(device=mesh.device_type)             # memory for this rank's shards, nothing more
    hf_model(model).tie_weights()                      # to_empty gave an unsharded tied head a tensor of its own
    with torch.no_grad():
        _fill_buffers(model)
        init_adapter(model, seed)
        _read_weights(model, cfg.path, mesh)
    return model


def _empty_model(cfg: ModelConfig) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    if cfg.attention == "flex_attention" and not torch.cuda.is_available():
        raise ForgeError("config error: model.attention=flex_attention needs a GPU (FlexAttention has no CPU "
                         "backward); use sdpa")
    try:
        config = AutoConfig.from_pretrained(local_dir(cfg.path), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise ForgeError(f"model error: model.path '{cfg.path}': cannot load a model config ({err})") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=cfg.attention,
                                                 trust_remote_code=cfg.trust_remote_code)
    return model


def _fill_buffers(model: nn.Module) -> None:
    """The buffers no checkpoint holds (rotary inv_freq) computed as transformers' own loading does."""
    hf = hf_model(model)
    for module in hf.modules():
        if module._non_persistent_buffers_set:
            hf._init_weights(module)


def _read_weights(model: nn.Module, path: str, mesh: DeviceMesh) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    state = {}      # a tied head is the embedding's tensor, files omit it; experts are read as the files hold them
    for name, tensor in _hf_state(model, with_tied_head=False).items():
        state.update(checkpoint_tensors(name, *local_experts(tensor)) if is_fused_experts(name) else {name: tensor})
    group = flat_group(mesh) if dist.is_initialized() else None
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(local_dir(path)), process_group=group,
                 no_dist=group is None)
    except CheckpointException as err:
        raise ForgeError(f"model error: model.path '{path}': its safetensors files do not hold the model's "
                         f"weights ({' '.join(str(err).split())[:300]})") from None


def _tied(model: nn.Module) -> bool:
    return bool(model.config.get_text_config().tie_word_embeddings)


def full_tensor(t: Tensor) -> Tensor:
    """The whole of a (D)Tensor (collective over its mesh if sharded)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _hf_state(model: nn.Module, with_tied_head: bool = True) -> dict[str, Tensor]:
    """{HF name: the model's (D)Tensor}, adapters left out; a tied head only `with_tied_head`."""
    state = {hf_name(k): t for k, t in model.state_dict().items() if ".lora_" not in k}
    if not with_tied_head and _tied(model):
        state.pop("lm_head.weight", None)
    return state


def hf_tensors(model: nn.Module, with_tied_head: bool = True):
    """(HF name, full tensor) one at a time, adapters merged in; collective over the model's group (every rank
    iterates, every rank gets each tensor)."""
    adapted = adapted_weights(model)
    for name, t in _hf_state(model, with_tied_head).items():
        if name in adapted:
            a = adapted[name]
            yield name, merge(full_tensor(a.weight), full_tensor(a.a), full_tensor(a.b), a.scale)
        else:
            yield from checkpoint_tensors(name, full_tensor(t))


def _adapter_tensors(model: nn.Module):
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            yield name, full_tensor(t)


def export_hf(model: nn.Module, tokenizer, out_dir: str | Path, group: dist.ProcessGroup | None = None,
              shard_bytes: int = 2 ** 30, adapter: bool = False) -> None:
    """Write a safetensors HF directory that transformers and vLLM load directly (adapters merged; with `adapter`
    also peft's adapter directory in `<out_dir>/adapter`); atomic (tmp + rename). A failed write (disk full, file
    too large) is the same ForgeError on every rank, the tmp dir removed and an earlier export untouched.

    Collective: every rank of the model's FSDP group (`group`) calls it; the group's first rank writes."""
    from safetensors import SafetensorError
    out_dir, writing = Path(out_dir), not dist.is_initialized() or dist.get_rank(group) == 0
    tmp, error = out_dir.with_name(out_dir.name + ".tmp"), None
    writer = _ShardedWriter(tmp, _file_sizes(model, shard_bytes))

    def attempt(write) -> None:                 # the first failure is kept; the gathers go on (collective)
        nonlocal error
        if writing and error is None:
            try:
                write()
            except (OSError, SafetensorError) as err:
                error = str(err)

    attempt(writer.open)
    for name, tensor in hf_tensors(model, with_tied_head=False):
        attempt(lambda: writer.add(name, tensor))
    gathered_adapter = dict(_adapter_tensors(model)) if adapter and has_adapter(model) else None
    attempt(lambda: _finish(model, tokenizer, writer, gathered_adapter, tmp, out_dir))
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if (error := first_on_any_rank(error, group)) is not None:
        raise ForgeError(f"export error: writing {out_dir} failed: {error}")


def _finish(model: nn.Module, tokenizer, writer: "_ShardedWriter", adapter: dict | None, tmp: Path, out_dir: Path):
    writer.finish()
    _write_config(model, tokenizer, tmp)
    if adapter is not None:
        save_adapter(model, adapter, tmp / "adapter")
    publish_dir(tmp, out_dir)


def _file_sizes(model: nn.Module, shard_bytes: int) -> list[int]:
    """How many tensors go into each file, known before any is gathered (so that files can be named n-of-N)."""
    counts, size = [0], 0
    shapes = [checkpoint_tensors(name, torch.empty(t.shape, dtype=t.dtype, device="meta"))
              for name, t in _hf_state(model, with_tied_head=False).items()]
    for _, t in (entry for entries in shapes for entry in entries):
        nbytes = t.numel() * t.element_size()
        if counts[-1] and size + nbytes > shard_bytes:
            counts.append(0)
            size = 0
        counts[-1], size = counts[-1] + 1, size + nbytes
    return counts


class _ShardedWriter:
    """Tensors in, safetensors files out (`model.safetensors`, or `model-0000k-of-0000N.safetensors` and the index)."""

    def __init__(self, tmp: Path, counts: list[int]):
        self.tmp, self.counts, self.pending, self.weight_map, self.total = tmp, counts, {}, {}, 0

    def open(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)

    def _file_name(self, i: int) -> str:
        n = len(self.counts)
        return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"

    def add(self, name: str, tensor: Tensor) -> None:
        self.pending[name] = tensor.detach().to("cpu", copy=False).contiguous()
        file_index = len({*self.weight_map.values()})
        if len(self.pending) == self.counts[file_index]:
            self._write(file_index)

    def _write(self, file_index: int) -> None:
        from safetensors.torch import save_file
        name = self._file_name(file_index)
        save_file(self.pending, self.tmp / name, metadata={"format": "pt"})
        for key, t in self.pending.items():
            self.weight_map[key] = name
            self.total += t.numel() * t.element_size()
        self.pending = {}

    def finish(self) -> None:
        if len(self.counts) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _write_config(model: nn.Module, tokenizer, tmp: Path) -> None:
    hf = hf_model(model)
    config = hf.config
    config.architectures = [_hf_class_name(hf)]
    config.save_pretrained(tmp)
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def _hf_class_name(model: nn.Module) -> str:
    """fully_shard swaps the class for `FSDP<Name>`; the exported config must name the HF class."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__
