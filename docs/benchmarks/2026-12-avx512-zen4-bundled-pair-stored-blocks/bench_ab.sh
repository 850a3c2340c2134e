#!/bin/bash
cd /work/main
run() { # which tag
  SPECDRAFT_CACHE=/tmp/ab-$1-cache HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab-$1/src .venv/bin/python -c "import sys; from specdraft.surfaces.cli import main; sys.argv[0]=\"specdraft\"; sys.exit(main())" bench --prompts ../shared/data/spec_bench/question.jsonl --prompts src/specdraft/bench/data/prompts.jsonl \
  --categories translation,summarization,qa,math_reasoning,rag,writing,roleplay,reasoning,math,coding,extraction,stem,humanities,code \
  --max-prompts 2 --turns 1 --threads 2 --max-new-tokens 128 --methods "ar,spec" --out /tmp/ab-out/$1-$2 > /tmp/ab-out/$1-$2.log 2>&1
}
mkdir -p /tmp/ab-out
# warm both caches (packing) with a tiny run
for c in old new; do SPECDRAFT_CACHE=/tmp/ab-$c-cache HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab-$c/src .venv/bin/python -c "import sys; from specdraft.surfaces.cli import main; sys.argv[0]=\"specdraft\"; sys.exit(main())" bench --categories code --max-prompts 1 --max-new-tokens 8 --methods ar,spec --threads 2 --out /tmp/ab-out/warm-$c > /tmp/ab-out/warm-$c.log 2>&1; done
run old 1; run new 1; run new 2; run old 2
echo done > /tmp/ab-out/DONE
