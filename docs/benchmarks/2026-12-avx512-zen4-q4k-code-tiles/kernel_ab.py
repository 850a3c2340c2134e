# Kernel A/B on one level: Q4_K tiles against the 4-bit tiles (int8 passes, and the exact path of a first token),
# one process: python kernel_ab.py N K (run from the checkout root)
import sys, time
sys.path.insert(0, "tests")
import numpy as np, torch
from test_gguf_native import random_q4k
from specdraft.kernels import q4k_tiles, prompt_pass, tiles
from specdraft.models.gguf_blocks import q4k_stored, q4k_affine
from specdraft.models.quantize import Int4Linear
torch.set_num_threads(2)
N, K = int(sys.argv[1]), int(sys.argv[2])
raw = torch.from_numpy(random_q4k(N, K // 256, np.random.default_rng(0)))
new = q4k_tiles.Q4KLinear(lambda a, b: q4k_stored(raw[a:b]), N, K)
old = Int4Linear.from_affine(*q4k_affine(raw))
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
for t in (1, 2, 3, 4, 5, 8, 16, 128):
    a = bench(int8(old._kernel), t); b = bench(int8(lambda xs: q4k_tiles.q4k_matmul(new.packed, xs)), t)
    print(f"{N}x{K} tokens {t}: int8 4-bit tiles {a:.3f} ms, Q4_K tiles {b:.3f} ms ({a/b:.2f}x)")
a = bench(old._kernel, 1); b = bench(lambda xs: q4k_tiles.q4k_matmul(new.packed, xs), 1)
print(f"{N}x{K} one token, exact path: 16-bit 4-bit tiles {a:.3f} ms, Q4_K tiles {b:.3f} ms ({a/b:.2f}x)")
