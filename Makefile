# loopbench make targets. `make bench` and `make test` do their own set-up on a fresh machine that has
# only Python; where the packages are already importable (the GPU host: system torch plus the carried
# wheels on PYTHONPATH) they install nothing and use that interpreter as it is.
PY ?= python3
VENV := .venv
NEEDS := import torch, triton, hydra, omegaconf, submitit, pandas, pyarrow, scipy, safetensors, matplotlib, pytest
PYTHON := $(shell if $(PY) -c "$(NEEDS)" >/dev/null 2>&1; then echo $(PY); else echo $(VENV)/bin/python; fi)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH),)

.PHONY: setup test test-slow test-gpu bench plan audit finish clean

setup:
ifeq ($(PYTHON),$(VENV)/bin/python)
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	@$(PYTHON) -c "$(NEEDS)" >/dev/null 2>&1 || { \
	  echo "setup: upgrading pip in $(VENV)/" && $(PYTHON) -m pip install -q --upgrade pip && \
	  echo "setup: installing torch==2.13.0 (the CPU build where the index has one; the largest download)" && \
	  $(PYTHON) -m pip install -q torch==2.13.0 && \
	  echo "setup: installing loopbench (editable) with triton, hydra-core, submitit, pandas, pyarrow, scipy, matplotlib, pytest" && \
	  $(PYTHON) -m pip install -q -e '.[test]' && echo "setup: done"; }
else
	@echo "using $(PYTHON): packages already importable, installing nothing"
endif

# `make test` leaves out the `slow`-marked tests (each more than about 10 s on 2 cores: whole bundles, SLURM jobs,
# engines under the Triton interpreter); `make test-slow` runs only those; CI (.ci/run) runs both.
# pytest exits 5 when it collects no tests; that is not a failure here.
test: setup
	@$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

test-slow: setup
	@$(PYTHON) -m pytest -q -m slow $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

test-gpu: setup
	@$(PYTHON) -m pytest -q -m gpu $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

# `loopbench bench` (harness/cli.py); `python -m loopbench` is the same command without the console script
bench: setup
	@$(PYTHON) -m loopbench bench $(ARGS)

audit: setup
	@test -n "$(BUNDLE)" || { echo "usage: make audit BUNDLE=results/<bundle-dir>"; exit 2; }
	@$(PYTHON) -m loopbench audit $(BUNDLE)

plan: setup
	@$(PYTHON) -m loopbench plan $(ARGS)

# publish, as incomplete, the bundle of a controller that died without publishing (then audits it)
finish: setup
	@test -n "$(BUNDLE)" || { echo "usage: make finish BUNDLE=results/<bundle-dir>"; exit 2; }
	@$(PYTHON) -m loopbench finish $(BUNDLE)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
