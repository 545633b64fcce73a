"""The rollout batch: G sampled completions per prompt with their logprobs (`Rollout`, what
`forge_core.engine.generate` returns), and its layouts: padding, concatenation, the balanced deal of groups over
policy ranks, and the trainer's shared-prompt rows.
"""

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Rollout", "pad_left", "pad_right", "SharedPromptRows", "shared_prompt_rows", "pad_cat", "cat_rollouts",
           "engine_share", "balanced_share"]


@dataclass
class Rollout:
    prompt_ids: Tensor                  # [B*G, P] left-padded (each prompt repeated G times)
    prompt_mask: Tensor                 # [B*G, P] 1 = real token
    completion_ids: Tensor              # [B*G, C] right-padded to the longest completion (<= max_tokens)
    completion_mask: Tensor             # [B*G, C] 1 = generated token
    sampler_logprobs: Tensor            # [B*G, C] vLLM's logprobs of the sampled tokens
    truncated: Tensor                   # [B*G] bool: hit max_tokens before its end of turn
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
    prompt_routes: Tensor | None = None       # [B*G, P, layers, k] the engine's experts (forge_core/routes.py)
    completion_routes: Tensor | None = None   # [B*G, C, layers, k]

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
    """Per-sequence tensors of several batches, one batch after the other: [n, width, ...] ones padded with 0 to
    the widest (on the left for left-padded prompts; routes with -1), [n] ones as they are."""
    if values[0].dim() == 1:
        return torch.cat(values)
    width, pad = max(v.shape[1] for v in values), -1 if values[0].dim() > 2 else 0
    return torch.cat([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + ((width - v.shape[1], 0) if left else
                                              (0, width - v.shape[1])), value=pad) for v in values])


def cat_rollouts(parts: list[Rollout]) -> Rollout:
    """The sequences of `parts` in order: prompts left-padded and completions right-padded to the widest part's
    (pads are 0, masked out); wall times are the first part's."""
    def cat(values: list, left: bool):
        if values[0] is None or isinstance(values[0], list):
            return None if values[0] is None else [x for v in values for x in v]
        if isinstance(values[0], dict):
            return {k: cat([v[k] for v in values], left) for k in values[0]}
        return pad_cat(values, left)
    fields = {k: cat([vars(p)[k] for p in parts], left=k.startswith("prompt")) for k in vars(parts[0])
              if k != "seconds"}
    return Rollout(**fields, seconds=dict(parts[0].seconds))


def engine_share(rollout: Rollout, rows: int, place: int, tp: int) -> Rollout:
    """The share of rank `place` of a tensor-parallel engine's `tp` ranks: every tp-th of its `rows` rows' samples.
    Those ranks run the engine in lockstep (vLLM's external launcher), so they sample the same rollout from the
    same prompts and seed; each then trains on (and counts) a different part of it."""
    if tp == 1:
        return rollout
    per_row = len(rollout) // rows
    return rollout.select([r * per_row + i for r in range(place, rows, tp) for i in range(per_row)])


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
    if mine.prompt_routes is not None:
        mine.prompt_routes = mine.prompt_routes[:, -prompt:]
    mine.seconds = dict(shares[me].seconds)
    return mine


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
    routes: Tensor | None = None        # [u, L, layers, k] the engine's experts per token (-1: none)

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
    routes = None
    if part.prompt_routes is not None:
        routes = part.prompt_routes.new_full((u, L, *part.prompt_routes.shape[2:]), -1)
        routes[:, :P], routes[rows, cols] = part.prompt_routes[first], part.completion_routes[real]
    return SharedPromptRows(ids, positions, owner, torch.arange(P - 1, L - 1, device=device),
                            group[:, None] * width + column, routes)


