# One-command setup: every target creates .venv/ if it is missing and brings it
# up to date when the pinned requirements change. Safe to run repeatedly.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install test demo bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt requirements-nodeps.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements-cpu.txt
	$(PIP) install --quiet --no-deps -r requirements-nodeps.txt
	$(PIP) install --quiet -e '.[dev]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/rcgrpo score --ground-truth --summary --quiet
	$(VENV)/bin/rcgrpo prepare-data out_dir=outputs/demo/data overwrite=true
	$(VENV)/bin/rcgrpo train --config-name rctp_smollm_cpu data.dir=outputs/demo/data run_dir=outputs/demo/rctp_smollm_cpu
	@echo "metrics: outputs/demo/rctp_smollm_cpu/metrics.jsonl (TensorBoard: outputs/demo/rctp_smollm_cpu/tensorboard); HF export: outputs/demo/rctp_smollm_cpu/hf"

bench: $(STAMP)
	$(PY) scripts/bench/env_replay.py --out docs/benchmarks.md --repeats 5
	$(PY) scripts/bench/prepare_data.py --out docs/benchmarks.md
	$(PY) scripts/bench/train_throughput.py --out docs/benchmarks.md

clean-venv:
	rm -rf $(VENV)
