"""One core's fp32 GEMM throughput on the linear layers of a model, torch's own (MKL on x86) beside oneDNN's
(`forge_core.model.onednn_linear`, what `fsdp.linear_kernel: onednn` trains with and the engines multiply by): which one
this CPU runs faster, and how close the GRPO step's GEMMs can come to the CPU's peak. Forward alone (what an engine
runs) and forward + backward (the trainer's three GEMMs per linear: y, the input's and the weight's gradients).

    python bench/bench_gemm.py                                   # the tiny model's shapes
    python bench/bench_gemm.py --model artifacts/smollm2-135m --tokens 512
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from forge_core.model import onednn_linear, use_onednn_linears  # noqa: E402


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of a Llama-style decoder layer, q/k/v and gate/up fused as vLLM runs them."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or h // config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    return {"qkv": (h + 2 * kv * head, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (config["vocab_size"], h)}


def seconds_per_call(fn, repetitions: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repetitions):
        fn()
    return (time.perf_counter() - t0) / repetitions


def train_step(linear: nn.Linear, x: torch.Tensor, grad: torch.Tensor):
    """Forward and backward of one linear, as the trainer runs it (both gradients)."""
    def run():
        x.grad = linear.weight.grad = None
        linear(x).backward(grad)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model dir; default runs/sft-tiny/hf or artifacts/tiny/init")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="rows of x: decode and prefill sizes")
    args = p.parse_args()
    model = args.model or next(str(REPO / d) for d in ("runs/sft-tiny/hf", "artifacts/tiny/init")
                               if (REPO / d / "config.json").exists())
    torch.set_num_threads(1)
    print(f"fp32 GEMM, 1 thread, {model}; GFLOP/s of x [tokens, in] @ W[out, in]^T (forward) and of it with both "
          "gradients (forward + backward, 3x the FLOPs)\n")
    print("| linear | tokens | forward: torch (MKL) | oneDNN | oneDNN / torch "
          "| forward + backward: torch (MKL) | oneDNN | oneDNN / torch |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (out, inp) in linear_shapes(json.loads(Path(model, "config.json").read_text())).items():
        for n in args.tokens:
            x, w = torch.randn(n, inp, requires_grad=True), torch.randn(out, inp)
            grad = torch.randn(n, out)
            gflop = 2 * n * out * inp / 1e9
            repetitions = max(3, int(2 / gflop))                                # about 2 GFLOP per contender
            with torch.no_grad():
                mkl = seconds_per_call(lambda: F.linear(x, w), repetitions)
                dnn = seconds_per_call(lambda: onednn_linear(x, w, None), repetitions)
            torch_linear, dnn_linear = (nn.Linear(inp, out, bias=False) for _ in range(2))
            use_onednn_linears(dnn_linear)                                      # the trainer's swap
            train_repetitions = max(3, repetitions // 3)
            mkl_train = seconds_per_call(train_step(torch_linear, x, grad), train_repetitions)
            dnn_train = seconds_per_call(train_step(dnn_linear, x, grad), train_repetitions)
            print(f"| {name} {out}x{inp} | {n} | {gflop / mkl:.1f} | {gflop / dnn:.1f} | {mkl / dnn:.2f} | "
                  f"{3 * gflop / mkl_train:.1f} | {3 * gflop / dnn_train:.1f} | {mkl_train / dnn_train:.2f} |")


if __name__ == "__main__":
    main()
