#!/usr/bin/env bash
# The GPU path's checks on one CUDA GPU that need PyTorch but no vLLM (GRPO with vLLM: tools/gpu_grpo_check.sh):
#   1. the GRPO trainer's math on the GPU: logprobs and gradients with FlexAttention's block mask = the dense mask's
#   2. bench/bench_mask.py at the Qwen3-1.7B config's micro-batch (random weights of its shape)
#   3. the tiny SFT job over CUDA + NCCL with SDPA and with FlexAttention, and a run stopped and resumed
#   4. the tiny Qwen3 SFT job (q/k norms) with FlexAttention
#      bash tools/gpu_check.sh [out_dir]      (needs the tiny jobs' files: python tools/build_tiny.py --out artifacts/tiny,
#                                              python tools/build_tiny.py --arch qwen3 --out artifacts/tiny_qwen3)
set -uo pipefail
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}
sft_args=(--train.eval_every 30 --ckpt.save_every 30 --train.steps 60)

nvidia-smi -L
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

echo "=== 1. the trainer's logprobs and gradients on the GPU"
timeout 300 $py -m pytest -q -p no:cacheprovider tests/test_grpo_math.py 2>&1 | tail -4

echo "=== 2. the attention mask at the Qwen3-1.7B micro-batch (1 prompt of 150 + 8 completions of 256-512 tokens)"
timeout 300 $py bench/bench_mask.py --model qwen3-1.7b-random --prompts 1 --prompt-tokens 150 \
    --completion-tokens 512 --repeats 3 2>&1 | grep -v "^Loading"

echo "=== 3. tiny SFT on CUDA + NCCL: SDPA, FlexAttention, and SDPA stopped at step 30 and resumed"
sft() { config=$1; shift; timeout 300 $py -m torch.distributed.run --standalone --nproc_per_node 1 train_sft.py \
        --config "configs/sft/$config.yaml" "${sft_args[@]}" "$@" 2>&1 | grep -E "^(sft|step|exported)|rror"; }
sft tiny --model.attention sdpa --out_dir "$out/sft-sdpa"
sft tiny --model.attention flex_attention --out_dir "$out/sft-flex"
sft tiny --model.attention sdpa --out_dir "$out/sft-resumed" --train.stop_at_step 30
sft tiny --model.attention sdpa --out_dir "$out/sft-resumed"

echo "=== 4. tiny Qwen3 SFT on CUDA + NCCL with FlexAttention"
sft tiny_qwen3 --model.attention flex_attention --out_dir "$out/sft-qwen3-flex"
for run in sdpa flex resumed qwen3-flex; do
    echo "sft-$run step 60: $(tail -n 1 "$out/sft-$run/metrics.jsonl")"
done
