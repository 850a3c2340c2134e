#!/bin/bash
# before (2edefeb, worktree) and after (working tree) loads, alternating, separate caches: load, a 91-token prompt, 64 tokens
cd /work/main && . .venv/bin/activate
export HF_HUB_OFFLINE=1
run() {  # version model
  if [ "$1" = before ]; then src=/tmp/s9/before/src; cache=/tmp/s9/cache-before; else src=/work/main/src; cache=/tmp/s9/cache-after; fi
  SPECDRAFT_CACHE=$cache PYTHONPATH=$src /usr/bin/time -f "whole %e s, peak %M KB" python /tmp/s9/loadrun.py /tmp/real_shapes/$2.gguf 2>&1 | grep -v "^kept\|^warning\|^unpacking" | sed 's/ (.*cpu)//' | tr '\n' ' '
  echo
}
for m in "$@"; do
  for v in before after; do echo "$m $v first: $(run $v $m)"; done
  for i in 1 2; do for v in before after; do echo "$m $v later $i: $(run $v $m)"; done; done
done
