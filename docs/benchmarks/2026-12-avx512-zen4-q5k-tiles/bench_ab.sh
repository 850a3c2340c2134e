#!/bin/bash
# Q5_K_M Llama-3.2-1B: before (d098753, 5-bit tiles with bf16 scales) and after (fcbe5c9, Q5_K tiles), alternating, separate caches
export HF_HUB_OFFLINE=1
F=/tmp/real_shapes/llama-3.2-1b-Q5_K_M.gguf
run() {  # version methods out
  cd /tmp/wt-$1 && SPECDRAFT_CACHE=/tmp/mem/cache-$1 PYTHONPATH=/tmp/wt-$1/src python -m specdraft.surfaces.cli bench --prompts ../shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat --methods $2 --target $F --out $3 2>&1 | grep -E "│|loaded|rror"
}
for i in 1 2 3; do  # round 3: --methods "ar,spec:drafter=oracle;oracle-alpha=0.8"
  for v in bench q5k; do
    m=ar; [ $i = 1 ] && m="ar,spec:drafter=oracle;oracle-alpha=0.8,llama-cpp"
    echo "== $v round $i $(date +%T)"; run $v "$m" /tmp/mem/q5k-$v-$i
  done
done
echo done $(date +%T)
