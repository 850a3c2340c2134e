# Set-up and entry points. `make demo` and `make test` work on a fresh machine: they create
# .venv, install the pinned CPU torch first (an unpinned one would pull a multi-GB CUDA
# build), then this package with its bundled-model packages and every extra (server, bench, loadtest, Ray
# Serve, the tests'), then build the native kernels
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
	$(PY) -m pip install -q -e '.[models,server,bench,loadtest,ray,dev,browser]'
	$(VENV)/bin/specdraft kernels
	touch $@

# Debian's Chromium for the playground's browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft generate "$(PROMPT)" --max-new-tokens 128

# Tests run one intra-op thread each (tests/conftest.py), so they run on every core (pytest-xdist, at most 4
# workers). `make test` (CI's command, the whole suite) puts `slow` tests first (tests/conftest.py) and lets a worker
# that runs dry take half of another's queue, so no long statistical test is left queued behind another; those
# marked `alone` (two kernel threads, Ray replicas, a server under load) run after, one at a time, as beside a
# second worker they would wait on each other's spinning OpenMP threads. The quick set goes a module to a worker
# (each module's fixtures built once).
XDIST := -n auto --maxprocesses 4

test: setup browser
	HF_HUB_OFFLINE=1 SPECDRAFT_REQUIRE_BROWSER=1 $(PY) -m pytest -q $(XDIST) --dist worksteal -m "not alone"
	HF_HUB_OFFLINE=1 SPECDRAFT_REQUIRE_BROWSER=1 $(PY) -m pytest -q -m alone

test-quick: setup browser
	HF_HUB_OFFLINE=1 SPECDRAFT_REQUIRE_BROWSER=1 $(PY) -m pytest -q $(XDIST) --dist loadscope -m "not slow"

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/specdraft bench --methods ar,spec,hf-ar,hf-assisted --max-prompts 5 --threads 2 --out bench_out/default

# Optional: the llama.cpp peers of `specdraft bench` and `specdraft loadtest --peer llama-server`, from one
# pinned source (llama-cpp-python's sdist, downloaded once; its vendor/llama.cpp): llama-cpp-python (the
# `llama-cpp` method) and llama.cpp's `llama-server` and `llama-bench` (the `llama-server*` methods), built
# natively (-DGGML_NATIVE=ON) under nice with 2 jobs (20-30 minutes on 2 cores). Each is run for a few tokens on
# the bundled target before it is kept; where the CPU has AMX and the native build crashes (as on a 2-core Xeon
# here: SIGILL or a segfault at the first generated token) it is built again with AMX off. The kept builds and
# their flags are recorded in ~/.cache/specdraft/llama.cpp/peers.json (the bench's machine block reports them),
# so a second `make peers` only checks, in seconds (`$(PY) -m specdraft.bench.peer_setup --force` builds and
# checks again). See src/specdraft/bench/peer_setup.py and llama_cpp_build.py. Not part of setup, so `make test`
# and CI never build it. diskcache is llama-cpp-python's one requirement that setup lacks (pip installs it with
# --no-deps).
peers: setup
	$(PY) -m pip install -q diskcache
	$(PY) -m specdraft.bench.peer_setup

clean:
	rm -rf $(VENV) build *.egg-info
