"""forge-spmd's mechanics; the scripts (train_sft.py, train_grpo.py, generate.py) hold the algorithms and call
down into these modules, one concern each:

    config    typed configs: YAML + dotted flags into the script's dataclasses; ForgeError, import_symbol
    dist      ranks and roles: process groups, meshes (a policy's tensor-parallel blocks), exchanges of Python
              objects, phases, run_main
    data      rows in (JSONL, Parquet, `datasets`), checked; chat formatting, SFT encoding, packing, sampling
    tasks     the synthetic tasks the tiny jobs learn (addition, multiplication, a guessing game)
    model     HF tokenizers and model directories, the template's end of turn, FSDP2 sharding (and offload)
    weights   a model built on the meta device and filled by each rank's own slices; streaming HF export
    tensor_parallel  each layer split over a node's ranks in training: the plan, the 2-D mesh, its checks
    lora      LoRA adapters (peft): added before sharding, trained alone, merged on the way out
    moe       Mixture-of-Experts: experts fused (trainer), per expert (files), packed (vLLM); routers' balance
    routes    routing replay (R3): the experts the engine chose per token, forced in the trainer's routers
    optim     AdamW and its schedule; a step that skips non-finite gradients
    logprobs  chosen-token logprobs (and entropy) from logits, a few rows at a time
    rollout   the Rollout batch and its layouts: padding, the deal of groups over ranks, shared prompts
    engine    the colocated vLLM engine: building it, sampling params, seeded draws, generate
    sync      FSDP shards into the engines by collectives (never through files)
    env       multi-turn episodes: the environment protocol and the turn loop (lock-step or continuous)
    sessions  an episode's KV cache kept across its turns: vLLM streaming-input sessions on the sync engine
    calls     user code called from threads, bounded in time: a pool whose hung calls are left behind
    games     games with seats: who plays each (self, a frozen snapshot, bots), the rounds, RAE
    held_out  held-out accuracy of the policy's engines, greedy and sampled; a run's before -> after line
    game_eval held-out play against each opponent, a game's exploitability, a run's before -> after lines
    snapshots the frozen opponent's pool of past policy snapshots, each rank a share, drawn per row
    sandbox   running model-written code isolated and bounded
    rootfs    a sandboxed call's root: the host's system directories read-only, a private /tmp; the mount table
    cgroups   a sandboxed call's cgroups (v1 or v2): its memory, processes and CPU; the memory of calls at once
    seccomp   the syscalls a sandboxed call may not make: a BPF filter that libseccomp builds
    scoring   reward functions in isolated worker processes; the reward config's view of them
    processes what user code starts, found and ended (descendants, subreapers)
    exchange  the GRPO step's two exchanges between policy and scoring ranks, and the scoring ranks' answers
    metrics   rank-0 output: console, TensorBoard, JSONL; cross-rank sums; a GRPO step's metrics
    ckpt      atomic, verifiable DCP checkpoints, resume, HF export paths
"""
