# Kernel A/B on one level: Q4_0 as stored (Q4_0 tiles) against the 4-bit tiles (bf16 scales), int8 passes and the
# exact path, one process: python q40_kernel_ab.py N K
import sys, time
import numpy as np, torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from specdraft.kernels import prompt_pass, q4_0_tiles, tiles
from specdraft.models.gguf_blocks import q4_0_stored, q4_affine
from specdraft.models.quantize import Int4Linear
torch.set_num_threads(2)
N, K = int(sys.argv[1]), int(sys.argv[2])
raw = torch.from_numpy(gguf_quantize(np.random.default_rng(0).normal(0, 0.05, (N, K)).astype(np.float32), GGMLQuantizationType.Q4_0))
old = Int4Linear.from_affine(*q4_affine(raw, "Q4_0"))
new = q4_0_tiles.Q40Linear(lambda a, b: q4_0_stored(raw[a:b]), N, K)
x = torch.randn(128, K).bfloat16()
def bench(f, t, reps=10):
    xs = x[:t]; f(xs); best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(reps): f(xs)
        best = min(best, (time.perf_counter() - s) / reps)
    return best * 1e3
def int8(f):
    def run(xs):
        with prompt_pass.prompt_pass():
            return f(xs)
    return run
print("level", tiles.tile_kernel().name)
for t in (1, 2, 4, 8, 128):
    a = bench(int8(old), t); b = bench(int8(new), t)
    print(f"{N}x{K} tokens {t}: 4-bit tiles (int8) {a:.3f} ms, Q4_0 tiles {b:.3f} ms ({a/b:.2f}x)")
a = bench(old, 1); b = bench(new, 1)
print(f"{N}x{K} one token, exact paths: 4-bit tiles (16-bit) {a:.3f} ms, Q4_0 tiles {b:.3f} ms ({a/b:.2f}x)")
