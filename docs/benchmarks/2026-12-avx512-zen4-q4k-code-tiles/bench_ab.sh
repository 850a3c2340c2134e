#!/bin/bash
# one `specdraft bench` per (version, target, methods): before (b8cdda9: AVX-512 Q4_K as 4-bit tiles, Q8_0 as two
# 4-bit halves) and after (1ff4585: both as the file stores them), each from its own worktree and cache folder.
# usage: bench_ab.sh MODEL METHODS_AFTER METHODS_BEFORE TAG
export HF_HUB_OFFLINE=1
B="--prompts /work/shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat"
m=$1; tag=$4
for v in after before; do
  methods=$2; [ $v = before ] && methods=$3
  cd /tmp/a5/$v && SPECDRAFT_CACHE=/tmp/a5/cache-$v PYTHONPATH=/tmp/a5/$v/src /work/main/.venv/bin/python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "$methods" --target /tmp/real_shapes/$m.gguf --out /tmp/a5/bench-$v-$m-$tag > /tmp/a5/bench-$v-$m-$tag.txt 2>&1
done
