#!/bin/bash
# The README's bench command on the bundled pair, before (b8cdda9) and after (HEAD), each from its worktree and cache
export HF_HUB_OFFLINE=1
for v in before after; do
  methods="ar,spec"; [ $v = after ] && methods="ar,spec,llama-cpp"
  cd /tmp/a5/$v && SPECDRAFT_CACHE=/tmp/a5/cache-$v PYTHONPATH=/tmp/a5/$v/src /work/main/.venv/bin/python -c "from specdraft.surfaces.cli import main; main()" bench --prompts /work/shared/data/spec_bench/question.jsonl --prompts src/specdraft/bench/data/prompts.jsonl \
  --categories translation,summarization,qa,math_reasoning,rag,writing,roleplay,reasoning,math,coding,extraction,stem,humanities,code \
  --max-prompts 2 --turns 1 --threads 2 --max-new-tokens 128 --methods "$methods" --out /tmp/a5/bundled-$v > /tmp/a5/bundled-$v.txt 2>&1
done
echo BUNDLED DONE $(date)
