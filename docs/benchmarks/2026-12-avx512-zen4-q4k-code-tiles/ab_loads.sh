#!/bin/bash
# later-load peaks: before and after, alternating, separate caches (loadrun.py: load, read a 91-token prompt, 64 tokens)
export HF_HUB_OFFLINE=1
run() {  # version model
  cd /tmp/a5/$1 && SPECDRAFT_CACHE=/tmp/a5/cache-$1 PYTHONPATH=/tmp/a5/$1/src /usr/bin/time -f "whole %e s, peak %M KB" /work/main/.venv/bin/python /tmp/a5/loadrun.py /tmp/real_shapes/$2.gguf 2>&1 | grep -v "^kept\|^warning\|^unpacking" | sed 's/ (.*cpu)//' | tr '\n' ' '
  echo
}
for m in "$@"; do
  for i in 1 2; do for v in before after; do echo "$m $v later $i: $(run $v $m)"; done; done
done
