#!/bin/bash
# F16 weights on AVX-512: PyTorch's bf16 linears (the loader's choice there) against the dense kernel (F16 as stored,
# float32 FMAs), the loader's choice patched in for this run only; separate cache folders
export HF_HUB_OFFLINE=1
B="--prompts /work/shared/data/spec_bench/question.jsonl --categories coding,writing,math_reasoning,qa,summarization,translation --max-prompts 1 --turns 1 --threads 2 --max-new-tokens 128 --no-chat --target /tmp/rs/llama-3.2-1b-F16.gguf"
cd /work/main
SPECDRAFT_CACHE=/tmp/a5/cache-bf16 .venv/bin/python -c "from specdraft.surfaces.cli import main; main()" bench $B --methods "ar,spec:drafter=oracle;oracle-alpha=0.8,llama-cpp" --out /tmp/a5/f16-bf16-linears > /tmp/a5/f16-bf16-linears.txt 2>&1
SPECDRAFT_CACHE=/tmp/a5/cache-dense .venv/bin/python -c "
from specdraft.kernels import dense_matmul, tiles
dense_matmul.available = lambda: tiles.tile_kernel() in (tiles.AVX2, tiles.AVX512)
from specdraft.surfaces.cli import main; main()" bench $B --methods "ar,spec:drafter=oracle;oracle-alpha=0.8" --out /tmp/a5/f16-dense > /tmp/a5/f16-dense.txt 2>&1
echo DENSE DONE $(date)
