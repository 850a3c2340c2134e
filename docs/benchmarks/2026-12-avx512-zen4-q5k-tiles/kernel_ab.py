# Kernel A/B on one level: Q5_K as stored (Q5_K tiles) against the 5-bit tiles (bf16 scales), int8 passes and the
# exact path, one process: python q5k_kernel_ab.py N K
import sys, time
sys.path.insert(0, "tests")
import numpy as np, torch
from test_gguf_native import random_q5k
from specdraft.kernels import prompt_pass, q4k_tiles, tiles
from specdraft.models.gguf_blocks import five_bit_affine, q4k_stored
from specdraft.models.quantize import Int4Linear
torch.set_num_threads(2)
N, K = int(sys.argv[1]), int(sys.argv[2])
raw = torch.from_numpy(random_q5k(N, K // 256, np.random.default_rng(0)))
old = Int4Linear.from_affine(*five_bit_affine(raw, "Q5_K"), bits=5)
new = q4k_tiles.Q4KLinear(lambda a, b: q4k_stored(raw[a:b], "Q5_K"), N, K, type_name="Q5_K")
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
    print(f"{N}x{K} tokens {t}: 5-bit tiles (int8) {a:.3f} ms, Q5_K tiles {b:.3f} ms ({a/b:.2f}x)")
a = bench(old, 1); b = bench(new, 1)
print(f"{N}x{K} one token, exact paths: 5-bit tiles (16-bit) {a:.3f} ms, Q5_K tiles {b:.3f} ms ({a/b:.2f}x)")
