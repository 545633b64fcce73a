"""Sharded loading and streaming export (forge_core/weights.py) on real torchrun ranks."""

from conftest import run_script


def test_sharded_load_equals_a_full_load_and_exports_stream_back(tmp_path):
    """Untied Llama, tied Llama, Qwen3 and Qwen3-MoE on 2 ranks, sharded and replicated: every weight and buffer and the
    logits bit for bit; the export loads back identical in one file or split into several (tests/load_check.py)."""
    proc = run_script("tests/load_check.py", [str(tmp_path)], nproc=2)
    assert proc.stdout.count("sharded load == full load, exports load back equal") == 4, proc.stdout[-2000:]
