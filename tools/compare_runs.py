"""GRPO runs side by side: each one's held-out lift (its console log's `held-out accuracy:` line), median step time
and peak memory of rank 0 (its metrics.jsonl). `make run-smol-lora` prints the full fine-tune beside LoRA.

    python tools/compare_runs.py full=runs/grpo-smollm2-gsm8k-style lora=runs/grpo-smollm2-gsm8k-style-lora

Each OUT_DIR holds metrics.jsonl and console.log (the run's output, as the Makefile tees it).
"""

import json
import re
import statistics
import sys
from pathlib import Path

LIFT = re.compile(r"held-out accuracy: greedy ([\d.]+) -> ([\d.]+) \((\d+) rows, s.e. ([\d.]+)\)")


def describe(name: str, out_dir: Path) -> str:
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    lifts = LIFT.findall((out_dir / "console.log").read_text())
    if not lifts:
        return f"{name}: {out_dir}/console.log has no held-out accuracy line (did the run finish?)"
    start, end, rows, se = lifts[-1]
    step_time = statistics.median(s["time/step"] for s in steps[1:] or steps)
    peak = max(s["mem/peak_gb_rank0"] for s in steps)
    return (f"{name}: greedy {start} -> {end} ({rows} rows, s.e. {se}), median step {step_time:.1f} s, "
            f"peak memory of rank 0 {peak:.2f} GB")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        name, _, out_dir = arg.partition("=")
        print(describe(name, Path(out_dir)))
