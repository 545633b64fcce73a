#!/usr/bin/env bash
# GRPO on a SLURM allocation: one torchrun per node, c10d rendezvous on the first node (slurm/launch.sh).
# Submit from the repository root; every #SBATCH line below can be overridden on the command line:
#   sbatch slurm/grpo.sh [config] [overrides...]
#   sbatch --nodes=2 --gpus-per-node=8 --cpus-per-task=64 --time=12:00:00 --partition=gpu \
#       slurm/grpo.sh configs/grpo/qwen3_8b_gsm8k_2nodes.yaml
# --nodes: one torchrun each. --gpus-per-node: one rank per GPU (not set here, so CPU clusters accept it).
# --cpus-per-task: CPUs per node, and without GPUs the number of ranks (nodes x ranks must equal
#   layout.policy + reference + reward; the tiny job uses 3).
# --time, --partition (default: the cluster's), --output: per-job log in logs/ (job name-job id).
# --signal: 300 s before the time limit the ranks save at the end of their step and the job requeues itself
#   (slurm/launch.sh); raise it where a step and a checkpoint take longer.
# Logs, restarts and environment knobs (NPROC_PER_NODE, MAX_RESTARTS, PYTHON): see slurm/launch.sh.
#SBATCH --job-name=forge-grpo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=3
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"      # sbatch runs a copy of this file; the repository is where it was submitted
exec bash slurm/launch.sh train_grpo.py configs/grpo/tiny.yaml "$@"
