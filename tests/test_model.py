"""What makes CPU training fast, checked without a process group: oneDNN linears, no page faults per step."""

import copy
import subprocess
import sys

import pytest
import torch
from torch.profiler import profile
from transformers import AutoModelForCausalLM

from conftest import REPO, script_env
from forge_core.model import use_onednn_linears


def test_onednn_linears_compute_what_torch_computes(tiny):
    reference = AutoModelForCausalLM.from_pretrained(tiny / "init")
    fast = copy.deepcopy(reference)
    use_onednn_linears(fast)
    assert type(fast.model.layers[0].mlp.down_proj).__name__ == "_OneDNNLinear"
    assert fast.state_dict().keys() == reference.state_dict().keys()

    ids = torch.randint(0, reference.config.vocab_size, (4, 12))
    losses = []
    for model in (reference, fast):
        with profile() as prof:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        losses.append(out.loss.item())
        used_onednn = any(e.key == "mkldnn::_linear_pointwise" for e in prof.key_averages())
        assert used_onednn == (model is fast)
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    for (name, p), q in zip(reference.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_cpu_process_keeps_freed_memory_and_flushes_denormals(tiny):
    """init_dist on CPU keeps freed memory for reuse: without it glibc gives each step's activations back to
    the OS and faults them in again (~6,900 page faults per step of the default SFT job, 20% of its time).
    It also flushes denormal floats to zero (GRPO's tiny gradients: 12% of its train phase)."""
    program = f"""
import resource, sys, torch
from forge_core.dist import init_dist
from transformers import AutoModelForCausalLM
if sys.argv[1] == "tuned":
    init_dist()
model = AutoModelForCausalLM.from_pretrained({str(tiny / "init")!r})
ids = torch.randint(0, model.config.vocab_size, (64, 20))
def step():
    model(input_ids=ids, labels=ids).loss.backward()
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10, (torch.tensor([1e-39]) * 1.0).item())
"""
    measured = {}
    for kind in ("plain", "tuned"):
        proc = subprocess.run([sys.executable, "-c", program, kind], cwd=REPO, env=script_env(), capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured[kind] = tuple(map(float, proc.stdout.split()[-2:]))
    (plain_faults, plain_denormal), (tuned_faults, tuned_denormal) = measured["plain"], measured["tuned"]
    assert tuned_faults < plain_faults / 4, measured
    assert plain_denormal > 0.0 and tuned_denormal == 0.0, measured


def test_bf16_if_native_follows_the_cpu_flags(monkeypatch):
    """`bf16_if_native` (fsdp.mixed_precision, engine.dtype): bf16 on GPU and where the CPU has AMX, fp32 elsewhere,
    AVX512-BF16 alone included (its bf16 GEMMs ran at half fp32's rate); `auto` stays fp32 on every CPU."""
    import forge_core.model as model_module
    from forge_core.engine import engine_dtype
    for flags, has_bf16, native in (("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True, True),
                                    ("fpu avx2 avx512f avx512_bf16", True, False), ("fpu avx2 fma", False, False)):
        monkeypatch.setattr(model_module, "_cpuinfo", lambda: f"processor\t: 0\nflags\t\t: {flags}\n")
        assert model_module.cpu_has_bf16() is has_bf16 and model_module.cpu_prefers_bf16() is native
        assert engine_dtype("bf16_if_native", on_gpu=False) == ("bfloat16" if native else "float32")
        assert model_module.bf16_chosen("bf16_if_native", on_gpu=False) is native
        assert engine_dtype("auto", on_gpu=False) == "float32" and not model_module.bf16_chosen("auto", False)
        assert engine_dtype("bf16_if_native", on_gpu=True) == "bfloat16" and engine_dtype("float16", False) == "float16"


def test_auto_linear_kernel_is_onednn_on_amd_with_avx512_only(monkeypatch):
    """`fsdp.linear_kernel: auto`: oneDNN where MKL keeps to AVX2 on a CPU that has AVX-512 (AMD Zen 4/5; 2.3x on
    a Zen 5), torch's MKL on AVX2-only AMD (a Zen 3's GRPO train phase 1.5x faster) and on Intel."""
    import forge_core.model as model_module
    for vendor, flags, kernel in (("AuthenticAMD", "fpu avx2 avx512f avx512_bf16", "onednn"),
                                  ("AuthenticAMD", "fpu avx2 fma", "torch"),
                                  ("GenuineIntel", "fpu avx2 avx512f amx_bf16", "torch")):
        monkeypatch.setattr(model_module, "_cpuinfo", lambda: f"vendor_id\t: {vendor}\nflags\t\t: {flags}\n")
        assert model_module.linear_kernel(model_module.FSDPConfig()) == kernel, (vendor, flags)
        assert model_module.linear_kernel(model_module.FSDPConfig(linear_kernel="onednn")) == "onednn"
