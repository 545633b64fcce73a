#!/usr/bin/env bash
# GRPO with the colocated vLLM engine on one CUDA GPU over NCCL, one rank (layout policy=1: each rank needs a GPU
# of its own under NCCL):
#   1. the default job (configs/grpo/tiny.yaml, bf16 by default on GPU): held-out accuracy before and after
#   2. the tiny Qwen3 job in fp32, trainer and engine: the engine's logprobs against the trainer's at every step
#   3. the same stopped at step 4 and resumed: does it land on the straight run's curve?
#      bash tools/gpu_grpo_check.sh [out_dir]   (needs vLLM, artifacts/tiny{,_qwen3} and runs/sft-tiny{,-qwen3}/hf:
#                                                make run and make run-qwen3 build them)
# Logs and metrics go to out_dir (default $OUT or runs/gpu_grpo_check), the runs themselves to $RUNS. A vLLM
# without FlashInfer needs VLLM_USE_FLASHINFER_SAMPLER=0 (its GPU sampler imports it otherwise).
set -uo pipefail
out=${1:-${OUT:-runs/gpu_grpo_check}}
runs=${RUNS:-/tmp/gpu_grpo_runs}
mkdir -p "$out" "$runs"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}
start=$(date +%s)

nvidia-smi -L
$py -c "import torch, transformers, vllm; print('torch', torch.__version__, 'transformers', transformers.__version__,
'vllm', vllm.__version__, torch.cuda.get_device_name())" 2>&1 | tail -n 3

grpo() {        # name, config, extra arguments: one rank, the log in $out/<name>.log
    name=$1; config=$2; shift 2
    timeout "${GRPO_TIMEOUT:-300}" $py -m torch.distributed.run --standalone --nproc_per_node 1 train_grpo.py \
        --config "configs/grpo/$config.yaml" --layout.reference 0 --layout.reward 0 --out_dir "$runs/$name" "$@" \
        >> "$out/$name.log" 2>&1
    echo "--- $name: exit $? at $(( $(date +%s) - start )) s"
    grep -E "^(step|held-out|exported|resumed)|rror" "$out/$name.log" | tail -n 6
    cp "$runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
}

qwen3_fp32=(--engine.dtype float32 --fsdp.mixed_precision fp32 --train.steps 8 --train.eval_every 0
            --ckpt.save_every 4 --data.eval_rows 16)
echo "=== 1. the default job"
grpo llama tiny
echo "=== 2. tiny Qwen3, fp32"
grpo qwen3 tiny_qwen3 "${qwen3_fp32[@]}"
echo "=== 3. tiny Qwen3, fp32, stopped at step 4 and resumed"
grpo qwen3_split tiny_qwen3 "${qwen3_fp32[@]}" --train.stop_at_step 4
grpo qwen3_split tiny_qwen3 "${qwen3_fp32[@]}"

$py - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
def rows(name):
    path = Path(sys.argv[1]) / f"{name}.metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
for name in ("llama", "qwen3", "qwen3_split"):
    steps = [r for r in rows(name) if "reward/mean" in r]
    if not steps:
        print(f"{name}: no steps"); continue
    median = lambda key: statistics.median(r[key] for r in steps[1:] or steps)
    print(f"{name}: {len(steps)} steps, reward {steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f}, "
          f"logprob gap max {max(r['loss/logprob_gap'] for r in steps):.2e}, step {median('time/step'):.3f} s "
          f"(generate {median('time/generate'):.3f}, train {median('time/train'):.3f}, sync {median('time/sync'):.4f}), "
          f"peak {max(r['mem/peak_gb_rank0'] for r in steps):.2f} GB")
straight, split = ({r["step"]: r for r in rows(name)} for name in ("qwen3", "qwen3_split"))
keys = ("reward/mean", "loss/entropy", "train/grad_norm")
worst = max((abs(split[s][k] - straight[s][k]) / max(abs(straight[s][k]), 1e-7) for s in straight if s in split
             for k in keys), default=float("nan"))
print(f"qwen3 resumed: steps {sorted(set(straight) & set(split))} logged by both, largest relative difference of "
      f"{', '.join(keys)}: {worst:.2e}")
EOF
