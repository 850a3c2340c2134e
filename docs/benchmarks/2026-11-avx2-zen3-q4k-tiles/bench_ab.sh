#!/bin/bash
# one `specdraft bench` per (version, target, methods): after (working tree) and before (the last commit's worktree)
cd /work/main && . .venv/bin/activate
export HF_HUB_OFFLINE=1
B="--prompts ../shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat"
m=$1; methods=$2; tag=$3
for v in after before; do
  src=/tmp/q4k/after/src; [ $v = before ] && src=/tmp/q4k/before/src
  SPECDRAFT_CACHE=/tmp/q4k/cache-$v PYTHONPATH=$src python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "$methods" --target /tmp/real_shapes/$m.gguf --out /tmp/q4k/bench-$v-$m-$tag > /tmp/q4k/bench-$v-$m-$tag.txt 2>&1
done
