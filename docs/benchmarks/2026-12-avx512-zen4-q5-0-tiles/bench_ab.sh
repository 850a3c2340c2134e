#!/bin/bash
# Gemma-3-1B Q4_K_M (its 1,152-wide rows in Q5_0) and Llama-3.2-1B Q4_0: before (d098753: 5- and 4-bit tiles with bf16
# scales) and after (6375703: Q5_0 and Q4_0 tiles on int8 activations per 32), alternating, separate caches
export HF_HUB_OFFLINE=1
run() {  # version methods file out
  cd /tmp/wt-$1 && SPECDRAFT_CACHE=/tmp/mem/cache-$1 PYTHONPATH=/tmp/wt-$1/src python -m specdraft.surfaces.cli bench --prompts ../shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat --methods $2 --target $3 --out $4 2>&1 | grep -E "│|loaded|rror"
}
G=/tmp/real_shapes/gemma-3-1b-Q4_K_M.gguf; L=/tmp/real_shapes/llama-3.2-1b-Q4_0.gguf
for i in 1 2; do
  for v in bench q50; do
    m=ar; [ $i = 1 ] && m="ar,llama-cpp"
    echo "== gemma $v round $i $(date +%T)"; run $v "$m" $G /tmp/mem/q50-gemma-$v-$i
  done
done
for v in bench q50; do echo "== llama-q4_0 $v $(date +%T)"; run $v ar $L /tmp/mem/q50-llama-$v; done
echo done $(date +%T)

# then the reversed order (after first) for Gemma:
# for v in q50 bench; do run $v ar $G OUT-$v; done
