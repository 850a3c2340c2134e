#!/bin/bash
# before (c68b2c6, worktree) and after (working tree) later loads, alternating, separate caches
cd /work/main && . .venv/bin/activate
export HF_HUB_OFFLINE=1
run() {  # version model
  if [ "$1" = before ]; then src=/tmp/wt-before/src; cache=/tmp/cache-before; else src=/work/main/src; cache=/tmp/cache-after; fi
  SPECDRAFT_CACHE=$cache PYTHONPATH=$src /usr/bin/time -f "whole %e s, peak %M KB" python /tmp/s7/loadrun.py /tmp/real_shapes/$2.gguf 2>&1 | grep -v "^kept\|^warning\|^unpacking" | sed 's/ (.*cpu)//' | tr '\n' ' '
  echo
}
for m in llama-3.2-1b-Q4_K_M qwen3-1.7b-Q4_K_M gemma-3-1b-Q4_K_M; do
  for v in before after; do echo "$m $v first: $(run $v $m)"; done
  for i in 1 2 3; do for v in before after; do echo "$m $v later $i: $(run $v $m)"; done; done
done
