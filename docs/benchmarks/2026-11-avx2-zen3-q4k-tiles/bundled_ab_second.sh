#!/bin/bash
# the bundled pair again, the other order: before, then after (ar, spec)
while [ ! -f /tmp/q4k/chain.done ]; do sleep 5; done
cd /work/main && . .venv/bin/activate && export HF_HUB_OFFLINE=1
B="--prompts ../shared/data/spec_bench/question.jsonl --prompts src/specdraft/bench/data/prompts.jsonl --categories translation,summarization,qa,math_reasoning,rag,writing,roleplay,reasoning,math,coding,extraction,stem,humanities,code --max-prompts 2 --turns 1 --threads 2 --max-new-tokens 128"
SPECDRAFT_CACHE=/tmp/q4k/cache-before PYTHONPATH=/tmp/q4k/before/src python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "ar,spec" --out /tmp/q4k/bundled-before2 > /tmp/q4k/bundled-before2.txt 2>&1
SPECDRAFT_CACHE=/tmp/q4k/cache-after PYTHONPATH=/tmp/q4k/after/src python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "ar,spec" --out /tmp/q4k/bundled-after2 > /tmp/q4k/bundled-after2.txt 2>&1
echo done > /tmp/q4k/chain2.done
