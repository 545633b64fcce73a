#!/usr/bin/env bash
# What slurm/sft.sh and slurm/grpo.sh run inside their allocation (the batch step, on its first node):
# one torchrun per node (srun --ntasks-per-node=1), all joining a c10d rendezvous on the first node.
#
#   bash slurm/launch.sh SCRIPT DEFAULT_CONFIG [CONFIG] [overrides...]
#   e.g. bash slurm/launch.sh train_grpo.py configs/grpo/tiny.yaml configs/grpo/qwen3_1_7b_gsm8k.yaml --loss.beta 0.04
#
# Ranks per node: NPROC_PER_NODE if set, else the node's GPUs (SLURM_GPUS_ON_NODE, else nvidia-smi), else the
# CPUs allocated on it (SLURM_CPUS_ON_NODE: the `--cpus-per-task` of the wrapper's header). A rank that dies
# makes torchrun restart every rank, up to MAX_RESTARTS times (default 3); the scripts then resume from the
# latest checkpoint in out_dir. A node that dies fails the srun step; `#SBATCH --requeue` then reruns the job,
# which resumes the same way. Other knobs: RDZV_PORT (default: a free port on the first node), PYTHON (an
# interpreter with torch; default `python`), OMP_NUM_THREADS (default 1), NCCL_* (GPU; defaults below).
set -euo pipefail
: "${SLURM_JOB_ID:?not inside a SLURM job: submit with sbatch slurm/sft.sh or sbatch slurm/grpo.sh}"
script=$1 config=$2
shift 2
if [[ $# -gt 0 && $1 != -* ]]; then      # a config file given before the overrides replaces the default
    config=$1
    shift
fi

PYTHON=${PYTHON:-python}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# This batch step runs on the first node, so a port free here is free where the rendezvous is hosted.
RDZV_PORT=${RDZV_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}

gpus=${SLURM_GPUS_ON_NODE:-0}
if [[ $gpus == 0 ]] && command -v nvidia-smi >/dev/null; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [[ $gpus -gt 0 ]]; then
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}   # a hung collective fails the rank
fi
nproc=${NPROC_PER_NODE:-$([[ $gpus -gt 0 ]] && echo "$gpus" || echo "${SLURM_CPUS_ON_NODE:-1}")}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}     # one thread per rank; more oversubscribes the cores
export PYTHONUNBUFFERED=1
# A restart must not reuse the rendezvous store: the new ranks would read the dead ranks' addresses from it
# and fail to connect (pytorch/pytorch#135712); unshared, each round's rank 0 hosts a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export LOGLEVEL=${LOGLEVEL:-INFO}               # torchrun's own log: rendezvous, failures, "will restart worker group"

# SLURM's warning before the time limit (the wrappers' `--signal=B:USR1@300`, to this shell) asks the ranks for a
# checkpoint at the end of their step (forge_core/ckpt.py); rank 0 then requeues the job, which resumes from it.
mkdir -p logs
export FORGE_CHECKPOINT_REQUEST=$PWD/logs/checkpoint-request-$SLURM_JOB_ID
rm -f "$FORGE_CHECKPOINT_REQUEST"
trap 'echo "launch: SIGUSR1, asking for a checkpoint"; touch "$FORGE_CHECKPOINT_REQUEST"' USR1
echo "launch: job $SLURM_JOB_ID, $SLURM_NNODES node(s) x $nproc rank(s) ($gpus GPU(s) per node)," \
     "rendezvous $head_node:$RDZV_PORT, max restarts ${MAX_RESTARTS:-3}: $script --config $config $*"
# --ntasks overrides an inherited SLURM_NTASKS (e.g. a user's --ntasks-per-node=8): one agent per node.
srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_NNODES" --nproc_per_node="$nproc" \
        --rdzv_backend=c10d --rdzv_endpoint="$head_node:$RDZV_PORT" --rdzv_id="$SLURM_JOB_ID" \
        --max_restarts="${MAX_RESTARTS:-3}" \
        "$script" --config "$config" "$@" &
step=$!
# In the background, so that the trap runs at once: a signal ends `wait` early (status > 128), the step goes on.
until wait "$step"; status=$?; ! kill -0 "$step" 2>/dev/null; do :; done
exit "$status"
