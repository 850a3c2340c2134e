#!/bin/bash
# before (53dcebb, worktree) and after (working tree) later loads, alternating, separate caches
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
export HF_HUB_OFFLINE=1
run() {  # version model
  if [ "$1" = before ]; then src=/tmp/wt-before/src; cache=/tmp/cache-before; else src=src; cache=/tmp/cache-after; fi
  SPECDRAFT_CACHE=$cache PYTHONPATH=$src /usr/bin/time -f "whole %e s, peak %M KB" python docs/benchmarks/2026-11-avx2-zen3-table-reads-lean-tokenizer/loadrun.py /tmp/real_shapes/$2.gguf 2>&1 | grep -v "^kept\|^warning\|^unpacking" | sed 's/ (.*cpu)//' | tr '\n' ' '
  echo
}
for m in "$@"; do
  for v in before after; do echo "$m $v first: $(run $v $m)"; done
  for i in 1 2 3; do for v in before after; do echo "$m $v later $i: $(run $v $m)"; done; done
done
