#!/bin/bash
cd /work/main && . .venv/bin/activate
export HF_HUB_OFFLINE=1 SPECDRAFT_CACHE=/tmp/cache-after
for m in llama-3.2-1b-Q4_K_M qwen3-1.7b-Q4_K_M gemma-3-1b-Q4_K_M; do
  echo "$m warm (builds the pickle): $(python /tmp/s7/loadrun.py /tmp/real_shapes/$m.gguf 2>&1 | sed 's/ (.*cpu)//' | tr '\n' ' ')"
  for i in 1 2 3; do echo "$m now later $i: $( /usr/bin/time -f "whole %e s, peak %M KB" python /tmp/s7/loadrun.py /tmp/real_shapes/$m.gguf 2>&1 | grep -v '^kept\|^warning' | sed 's/ (.*cpu)//' | tr '\n' ' ')"; done
done
