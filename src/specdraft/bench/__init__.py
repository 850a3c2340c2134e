"""`specdraft bench`: methods side by side on the same prompts, weights and token budget.

prompts  Spec-Bench JSONL in, a selection out
methods  the registry of methods (`ar`, `spec`, the transformers peers, the llama.cpp peers) and their option strings
llama_cpp_peer  the `llama-cpp` peer: llama.cpp decoding the target's GGUF file (optional package)
llama_server_peer  the `llama-server` peers: llama.cpp's server, plain and speculating (`llama_server`: the process)
loadtest  `specdraft loadtest`: concurrent streaming clients against a server (`loadtest_peers`: llama-server's)
peer_setup  `make peers`: llama.cpp built from one pinned source (`llama_cpp_build`), smoke-tested, the build kept
runner   runs them interleaved per prompt, resumable, into OUT/results.jsonl
summary  records to figures (pure arithmetic) and the markdown report
plots    the PNG plots beside summary.json
"""

from specdraft.bench.methods import METHODS, MethodSpec, parse_method, parse_methods
from specdraft.prompts import Prompt, default_prompts_path, load_prompts, select_prompts
from specdraft.bench.runner import BenchConfig, BenchResult, run_bench
from specdraft.bench.summary import ExactnessError, check_exactness, find_mismatches, render_report, summarize

__all__ = [
    "METHODS", "BenchConfig", "BenchResult", "ExactnessError", "MethodSpec", "Prompt", "check_exactness",
    "default_prompts_path", "find_mismatches", "load_prompts", "parse_method", "parse_methods", "render_report",
    "run_bench", "select_prompts", "summarize",
]
