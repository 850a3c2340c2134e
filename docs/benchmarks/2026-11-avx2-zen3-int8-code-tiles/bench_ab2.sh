#!/bin/bash
# one `specdraft bench` per (version, target, methods): after (working tree) and before (2edefeb worktree)
cd /work/main && . .venv/bin/activate
export HF_HUB_OFFLINE=1
B="--prompts ../shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat"
m=$1; after=$2; before=$3
SPECDRAFT_CACHE=/tmp/s9/cache-after PYTHONPATH=/work/main/src python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "$after" --target /tmp/real_shapes/$m.gguf --out /tmp/s9/bench-after-$m > /tmp/s9/bench-after-$m.txt 2>&1
SPECDRAFT_CACHE=/tmp/s9/cache-before PYTHONPATH=/tmp/s9/before/src python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "$before" --target /tmp/real_shapes/$m.gguf --out /tmp/s9/bench-before-$m > /tmp/s9/bench-before-$m.txt 2>&1
