"""Process groups and device meshes: nccl+cuda when a GPU exists, gloo+cpu otherwise.

Every rank builds every group, in the same order (torch's `new_group` is collective over the world).
Without torchrun the same code runs as a single process (world size 1).

`run_main(main)` is how a script ends when something goes wrong: a `ForgeError` becomes one line, printed once
for the job (not once per rank), and exit code 2; a collective that fails (a rank died, or one stopped
answering for `dist.timeout_s`) one line naming this rank, its role, its phase (`set_phase`) and where the
other ranks were, and exit code 1, so that torchrun ends the job (and `--max-restarts` restarts it).
"""

import contextlib
import ctypes
import gc
import hashlib
import itertools
import os
import pickle
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from pydantic import PositiveFloat
from torch.distributed.device_mesh import DeviceMesh

from .config import ForgeError
from .tensor_parallel import training_mesh

__all__ = ["Dist", "DistConfig", "Layout", "Roles", "init_dist", "init_roles", "role_ranks", "close_dist", "exchange",
           "wait_idle", "release", "set_phase", "run_main", "published_world_calls", "mirror_world_calls"]


@dataclass
class DistConfig:
    # How long a rank may wait in a collective before the job ends. Ranks wait for one another through a
    # held-out eval, a checkpoint, the final export and the engines' start (GRPO's reward and reference ranks
    # for the policy's), which take minutes on a large model: the default leaves room for them.
    timeout_s: PositiveFloat = 1800.0


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    ranks_per_node: int                 # torchrun's --nproc_per_node
    device: torch.device
    mesh: DeviceMesh                    # the world: 1-D (SFT data parallel + FSDP), or ("dp", "tp") with
                                        # tensor parallelism (forge_core/tensor_parallel.py)
    timeout: timedelta                  # of every process group we create
    store: dist.Store                   # the rendezvous store, where idle ranks wait (`wait_idle`)
    data_rank: int = 0                  # which share of the data this rank trains on (its tensor-parallel
    data_ranks: int = 1                 # block's: every rank of one trains on the same); how many shares

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks that together hold one copy of the model (None: the world), over which sums are taken."""
        return self.mesh["dp"].get_group() if self.mesh.ndim == 2 else None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


@dataclass
class Layout:
    """How many ranks play each GRPO role; they must add up to the world size torchrun started."""
    policy: int = 1                     # train (FSDP2) and generate (colocated vLLM)
    reference: int = 1                  # frozen initial policy: per-token logprobs for the KL term
    reward: int = 1                     # reward functions and the optional reward model


@dataclass
class Roles:
    dist: Dist
    policy_ranks: list[int]
    reference_ranks: list[int]
    reward_ranks: list[int]
    scoring_ranks: list[int]                        # exchange rollouts and scores; the others have no work
    policy_mesh: DeviceMesh | None = None           # only on policy ranks: 1-D, or ("dp", "tp")
    reference_mesh: DeviceMesh | None = None        # only on reference ranks
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    tensor_parallel: int = 1                        # policy ranks per block that splits each layer in training

    @property
    def data_rank(self) -> int:
        """Which share of the policy's data this policy rank trains on: its tensor-parallel block's (every rank
        of a block trains on the same sequences)."""
        return self.policy_ranks.index(self.rank) // self.tensor_parallel

    @property
    def data_ranks(self) -> int:
        return len(self.policy_ranks) // self.tensor_parallel

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """One policy rank of each block, this one's: over them the policy's sums and exchanges are taken."""
        return self.policy_mesh["dp"].get_group() if self.tensor_parallel > 1 else self.groups["policy"]

    @property
    def speaks_for_block(self) -> bool:
        """The first rank of its block: it alone sends the block's sequences to be scored."""
        return self.policy_ranks.index(self.rank) % self.tensor_parallel == 0

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def is_policy(self) -> bool:
        return self.rank in self.policy_ranks

    @property
    def is_reference(self) -> bool:
        return self.rank in self.reference_ranks

    @property
    def is_reward(self) -> bool:
        return self.rank in self.reward_ranks

    @property
    def is_idle(self) -> bool:
        return self.rank not in self.scoring_ranks


@dataclass
class _Whereabouts:
    """What this rank is doing, for the line a failure prints. Each phase is also published to the store,
    where the rank that notices a failure reads which rank stopped answering, and in which phase."""
    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", "0")))
    role: str = ""                      # policy | reference | reward; "" outside GRPO
    phase: str = "start"
    since: float = field(default_factory=time.time)
    store: dist.Store | None = None     # None before the process group exists


_here = _Whereabouts()
_RANK0_GRACE_S = 10.0       # how long other ranks leave rank 0 to report an error that every rank found


def set_phase(name: str, since: float | None = None) -> None:
    """Name what this rank does from now on (generate, train, sync, eval, checkpoint, ...)."""
    _here.phase, _here.since = name, since or time.time()
    if _here.store is not None:
        _here.store.set(f"phase/{_here.rank}", f"{_here.role}|{name}|{_here.since}")


def freeze_startup_objects() -> None:
    """The end of a script's start-up. The scripts begin with the collector off: importing torch, transformers
    and vLLM builds ~600k objects that live as long as the process, and collecting while they arrived cost ~3 s
    a rank (Zen 3). Frozen here, no collection walks them again (vLLM collects some seven times while it builds
    an engine, 0.6 s a walk); the collector runs again for what comes next."""
    gc.freeze()
    gc.enable()


def init_dist(cfg: DistConfig = DistConfig(), tensor_parallel: int = 1) -> Dist:
    """Join (or, without torchrun, create) the default process group and a world mesh (2-D with
    `tensor_parallel` > 1: blocks of that many consecutive ranks split each layer)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        _tune_cpu_process()
    timeout = timedelta(seconds=cfg.timeout_s)
    # Known before the group is joined: a rank whose join fails because a peer left with an error (a peer can
    # finish joining first and raise) finds that peer's report in the store and stays silent.
    store = _here.store = _attempt_store()
    set_phase(_here.phase)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % tensor_parallel or per_node % tensor_parallel:
        raise ForgeError(f"config error: fsdp.tensor_parallel_size={tensor_parallel} does not divide the "
                         f"{world_size} ranks ({per_node} per node): a tensor-parallel block stays in a node")
    mesh = training_mesh(list(range(world_size)), device.type, tensor_parallel)
    return Dist(rank, local_rank, world_size, per_node, device, mesh, timeout, store,
                rank // tensor_parallel, world_size // tensor_parallel)


def role_ranks(layout: Layout, world_size: int) -> tuple[list[int], list[int], list[int]]:
    """policy | reference | reward ranks, in that order; a layout that does not fit the world is an error."""
    if min(layout.policy, layout.reference, layout.reward) < 0 or layout.policy < 1:
        raise ForgeError(f"config error: layout needs policy >= 1 and no negative counts, got {layout}")
    needed = layout.policy + layout.reference + layout.reward
    if needed != world_size:
        raise ForgeError(f"config error: layout policy={layout.policy} reference={layout.reference} "
                         f"reward={layout.reward} needs {needed} ranks; torchrun started {world_size}")
    ranks = list(range(needed))
    reference_end = layout.policy + layout.reference
    return ranks[:layout.policy], ranks[layout.policy:reference_end], ranks[reference_end:]


def init_roles(layout: Layout, cfg: DistConfig = DistConfig(), reference_scores: bool = True,
               tensor_parallel: int = 1) -> Roles:
    """Split the world into policy | reference | reward ranks with a group and mesh each, and a `scoring`
    group: the ranks that exchange rollouts and scores (the reference ranks only if they compute something).
    `tensor_parallel` > 1: the policy's mesh is ("dp", "tp"), blocks of that many consecutive policy ranks, and so is
    the reference's where their number is a multiple of it (else FSDP alone over them)."""
    d = init_dist(cfg)
    policy, reference, reward = role_ranks(layout, d.world_size)
    if len(policy) % tensor_parallel:
        raise ForgeError(f"config error: fsdp.tensor_parallel_size={tensor_parallel} does not divide "
                         f"layout.policy={len(policy)}")
    scoring = sorted(policy + reward + (reference if reference_scores else []))
    roles = Roles(d, policy, reference, reward, scoring, tensor_parallel=tensor_parallel)
    _here.role = "policy" if roles.is_policy else "reference" if roles.is_reference else "reward"
    for name, ranks in (("policy", policy), ("reference", reference), ("reward", reward), ("scoring", scoring)):
        roles.groups[name] = dist.new_group(ranks, timeout=d.timeout) if ranks else None   # not inherited
    # 2-D meshes: every rank builds them (and their flattened groups), since the world creates a mesh's groups
    if tensor_parallel > 1:
        roles.policy_mesh = _block_mesh(policy, d.device.type, tensor_parallel, roles.is_policy)
        if reference and len(reference) % tensor_parallel == 0:     # else FSDP alone over them
            roles.reference_mesh = _block_mesh(reference, d.device.type, tensor_parallel, roles.is_reference)
    if roles.is_policy and roles.policy_mesh is None:
        roles.policy_mesh = DeviceMesh.from_group(roles.groups["policy"], d.device.type)
    if roles.is_reference and roles.reference_mesh is None:
        roles.reference_mesh = DeviceMesh.from_group(roles.groups["reference"], d.device.type)
    return roles


def _block_mesh(ranks: list[int], device_type: str, tensor_parallel: int, member: bool) -> DeviceMesh | None:
    """A role's ("dp", "tp") mesh, built by every rank of the world; its members get it."""
    mesh = training_mesh(ranks, device_type, tensor_parallel)
    mesh._flatten()
    return mesh if member else None


def exchange(payload, group: dist.ProcessGroup | None = None) -> list:
    """Every rank contributes one picklable object and receives everyone's (rank order). It is how token
    ids go out to the reference and reward ranks and how rewards and logprobs come back. A group of one rank
    (one policy rank re-dealing its own rollout, a policy-only layout's scoring) has nothing to send."""
    if dist.get_world_size(group) == 1:
        return [payload]
    phase, since = _here.phase, _here.since
    set_phase("exchange")
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    set_phase(phase, since)
    return gathered


def wait_idle(d: Dist, key: str) -> None:
    """A rank with nothing to do waits for `release(d, key)` on the store, outside any collective: a collective
    would time out (`dist.timeout_s`) long before a long run ends."""
    set_phase("idle")
    d.store.wait([key], timedelta(days=365))


def release(d: Dist, key: str) -> None:
    d.store.set(key, "1")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


_startups = itertools.count()       # the start-ups of this process: the policy and outsider ranks count alike


@contextlib.contextmanager
def published_world_calls(d: Dist, outsiders: list[int]):
    """Around a library's start-up that some ranks run (vLLM's engines, on the policy ranks) but that creates
    process groups over the whole world, which every rank must create in the same order: rank 0 writes each
    `new_group` call, and each all-reduce over a group with an outsider in it, to the store, where
    `mirror_world_calls` on the `outsiders` makes the same calls without the library (running vLLM's group
    set-up cost a reference or reward rank of the tiny job 2.6 s of CPU and 190 MB). Every rank that runs the
    start-up enters; rank 0 publishes. Each start-up (a second engine's too) has keys of its own."""
    startup = next(_startups)
    if d.rank != 0 or not outsiders:
        yield
        return
    new_group, all_reduce = dist.new_group, dist.all_reduce
    created: list[dist.ProcessGroup] = []
    published = itertools.count()

    def publish(*call) -> None:
        d.store.set(f"world_calls/{startup}/{next(published)}", pickle.dumps(call))

    def publishing_new_group(ranks=None, **kwargs):
        publish("new_group", ranks, kwargs)
        created.append(new_group(ranks, **kwargs))
        return created[-1]

    def publishing_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is None or set(outsiders) & set(dist.get_process_group_ranks(group)):
            name = next((n for n, o in _REDUCE_OPS.items() if o == op), None)
            if name is None:
                raise RuntimeError(f"an all-reduce ({op}) over the ranks without an engine cannot be mirrored")
            publish("all_reduce", None if group is None else created.index(group), name, tensor.dtype,
                    tuple(tensor.shape), tensor.device.type)
        return all_reduce(tensor, op, group, async_op)

    dist.new_group, dist.all_reduce = publishing_new_group, publishing_all_reduce
    try:
        yield
    finally:
        dist.new_group, dist.all_reduce = new_group, all_reduce
        publish("end")


def mirror_world_calls(d: Dist) -> None:
    """On a rank outside `published_world_calls`: make its calls, as rank 0 publishes them, until it ends;
    an all-reduce gets the operation's identity (the largest value for a MIN), which changes nothing."""
    created, startup = [], next(_startups)
    for index in itertools.count():
        key = f"world_calls/{startup}/{index}"
        d.store.wait([key], d.timeout)
        call, *args = pickle.loads(d.store.get(key))
        if call == "end":
            return
        if call == "new_group":
            ranks, kwargs = args
            created.append(dist.new_group(ranks, **kwargs))
            continue
        group, op, dtype, shape, device = args
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        identity = {"sum": 0, "min": info.max, "max": info.min}[op]
        tensor = torch.full(shape, identity, dtype=dtype, device=d.device if device != "cpu" else "cpu")
        dist.all_reduce(tensor, _REDUCE_OPS[op], None if group is None else created[group])


def close_dist() -> None:
    """The end of a job, on every rank: wait for the others, then leave the group. A vLLM engine is not shut
    down first: `run_main` ends the process right after, and the engine's shutdown cost ~3 s of CPU a rank
    (Zen 3) in two `gc.collect()` calls over the whole heap, which vLLM unfreezes for them."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_main(main: Callable[[], Any]) -> None:
    """Run a script's main: a ForgeError or a failed collective ends it with one line and no traceback. A main
    that returns leaves without the interpreter's teardown: there, after the last checkpoint, a rank of a
    finished 2-rank SFT run once aborted in C++ ("terminate called without an active exception"), which
    torchrun reports as a failed job."""
    try:
        main()
        _exit(0)
    except ForgeError as err:
        _report(str(err), f"error/{hashlib.sha1(str(err).encode()).hexdigest()}")
        _exit(2)
    except RuntimeError as err:
        if not (isinstance(err, dist.DistError) or "/gloo/" in str(err)):
            raise
        reason = re.sub(r"^\[[^]]*\] ", "", str(err).strip().splitlines()[0]).split(". ")[0]
        _report(f"collective failed in phase {_here.phase} after {time.time() - _here.since:.0f} s: {reason}"
                f"{_elsewhere()}", None)
        time.sleep(2)       # torchrun blames the first rank to exit: if a peer died, that must stay the peer
        _exit(1)


def _report(message: str, key: str | None) -> None:
    """Print `message` once for the job. Before the store exists every rank reads the same config, so
    rank 0 prints; the others wait first, as torchrun ends them once rank 0 has left, and print only if it
    did not (the error was theirs alone). After, the first rank to find a message prints it (the store counts).
    A failed collective (`key` None) is printed only if no rank reported before: then it is most likely the
    echo of that rank's exit."""
    first = _here.rank == 0
    if _here.store is None and not first:
        time.sleep(_RANK0_GRACE_S)
        first = True
    elif _here.store is not None:
        try:
            _here.store.set_timeout(timedelta(seconds=5))
            reported_before = _here.store.add("reported", 1) > 1
            first = _here.store.add(key, 1) == 1 if key is not None else not reported_before
        except RuntimeError:            # the store went with its host (rank 0, on several nodes): say it anyway
            first = True
    if first:
        tag = f"[{_who(_here.rank, _here.role)}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"{tag}{message}", file=sys.stderr, flush=True)


def _elsewhere() -> str:
    """Where the other busy ranks were, the longest in their phase first: one that stopped answering is there.
    Nowhere to read before the store exists."""
    if _here.store is None:
        return ""
    try:
        _here.store.set_timeout(timedelta(seconds=5))
        keys = [f"phase/{r}" for r in range(int(os.environ["WORLD_SIZE"])) if r != _here.rank]
        found = [k for k in keys if _here.store.check([k])]
        phases = [v.decode().split("|") for v in _here.store.multi_get(found)] if found else []
    except RuntimeError:
        return ""
    busy = sorted((float(since), f"{_who(int(k[6:]), role)} in {phase} for {time.time() - float(since):.0f} s")
                  for k, (role, phase, since) in zip(found, phases) if phase != "idle")
    return "".join(f"; {text}" for _, text in busy[:3])


def _who(rank: int, role: str) -> str:
    return f"rank {rank} {role}".strip()


def _exit(code: int) -> None:
    """Leave now: tearing down a process group or an engine after a failed collective can hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _attempt_store() -> dist.Store:
    """The rendezvous store, namespaced by torchrun's restart count. After `--max-restarts` restarts the
    workers, torchrun hands them the same agent store, where the dead attempt's gloo/NCCL addresses still
    sit: without the namespace the new group connects to dead ports (pytorch#167288). On several nodes the
    restart counts of the agents can differ, so there the launcher must give each round a fresh store
    instead: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (slurm/ sets it)."""
    store, _, _ = next(dist.rendezvous("env://"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if agent_store and int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1:
        return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return store


def _tune_cpu_process() -> None:
    """Two process-wide settings that CPU training needs to be fast:
    - glibc malloc maps each large block fresh and hands freed heap back to the OS, so every training step
      page-faults its activations in again (~6,900 faults and 20% of an SFT step of the tiny model here):
      keep freed memory for reuse instead (what tcmalloc/jemalloc do);
    - GRPO's small gradients reach denormal floats, which CPUs compute on slowly (12% of a GRPO train phase
      here): flush them to zero."""
    torch.set_flush_denormal(True)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:                 # not glibc (macOS, musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 2**30)       # up to 1 GB from the heap: a step's logits and gradients too
    libc.mallopt(m_trim_threshold, 2**30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
