#!/bin/bash
# Llama-3.2-1B in Q5_K_M, Q4_0, Q8_0: ar vs llama.cpp on this machine (commit d098753)
export HF_HUB_OFFLINE=1 PYTHONPATH=src
# from the checkout root
for q in Q5_K_M Q4_0 Q8_0; do
  f=/tmp/real_shapes/llama-3.2-1b-$q.gguf
  [ -f $f ] || python -m specdraft.bench.random_gguf --shape llama-3.2-1b --quant $q --out $f > /dev/null 2>&1
  echo "== $q $(date +%T) $(stat -c %s $f)"
  python -m specdraft.surfaces.cli bench --prompts ../shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat --methods ar,llama-cpp --target $f --out docs/benchmarks/2026-12-avx512-zen4-block-types-memory-floor/llama-3.2-1b-$q 2>&1 | grep -E "│|loaded|error|Error"
done
echo done $(date +%T)
