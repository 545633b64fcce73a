"""One core's GEMM throughput on the linear layers of a model: in fp32, torch's own (MKL on x86) beside oneDNN's
(`forge_core.model.onednn_linear`, what `fsdp.linear_kernel: onednn` trains with and the engines multiply by): which one
this CPU runs faster, and how close the GRPO step's GEMMs can come to the CPU's peak. Forward alone (what an engine
runs) and forward + backward (the trainer's three GEMMs per linear: y, the input's and the weight's gradients).
Then torch's GEMMs in bf16 against fp32: what `bf16_if_native` (fsdp.mixed_precision, engine.dtype) decides between
by the CPU's flags (bf16 with AMX), to check that rule on a new CPU kind.

    python bench/bench_gemm.py                                   # the tiny model's shapes
    python bench/bench_gemm.py --model artifacts/smollm2-135m --tokens 512
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from forge_core.model import cpu_prefers_bf16, onednn_linear, use_onednn_linears  # noqa: E402


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
    bf16_rows, bf16_train_ratios = [], []
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
            label = f"{name} {out}x{inp} | {n}"
            print(table_row(label, gflop, (mkl, mkl_train), (dnn, dnn_train)))
            bf16 = bf16_seconds(out, inp, n, repetitions, train_repetitions)
            bf16_rows.append(table_row(label, gflop, (mkl, mkl_train), bf16))
            bf16_train_ratios.append(mkl_train / bf16[1])
    print("\nbf16 against fp32, torch's GEMMs (fp32: the torch column above), GFLOP/s as above\n")
    print("| linear | tokens | forward: fp32 | bf16 | bf16 / fp32 | forward + backward: fp32 | bf16 | bf16 / fp32 |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(bf16_rows))
    print(f"\nbf16_if_native takes {'bf16' if cpu_prefers_bf16() else 'fp32'} on this CPU (bf16 with AMX); measured "
          f"here, bf16's forward + backward ran at {statistics.median(bf16_train_ratios):.2f}x fp32's rate (median)")


def bf16_seconds(out: int, inp: int, n: int, repetitions: int, train_repetitions: int) -> tuple[float, float]:
    """torch's bf16 GEMMs at one shape: seconds per forward and per forward + backward."""
    x = torch.randn(n, inp, dtype=torch.bfloat16, requires_grad=True)
    linear = nn.Linear(inp, out, bias=False, dtype=torch.bfloat16)
    grad = torch.randn(n, out, dtype=torch.bfloat16)
    with torch.no_grad():
        forward = seconds_per_call(lambda: linear(x), repetitions)
    return forward, seconds_per_call(train_step(linear, x, grad), train_repetitions)


def table_row(label: str, gflop: float, base: tuple[float, float], other: tuple[float, float]) -> str:
    """GFLOP/s of two contenders (seconds of a forward, of a forward + backward) and the other's speed-up."""
    (fwd, train), (other_fwd, other_train) = base, other
    return (f"| {label} | {gflop / fwd:.1f} | {gflop / other_fwd:.1f} | {fwd / other_fwd:.2f} | "
            f"{3 * gflop / train:.1f} | {3 * gflop / other_train:.1f} | {train / other_train:.2f} |")

if __name__ == "__main__":
    main()
