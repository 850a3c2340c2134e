# Kernel A/B on one level: Q8_0 code tiles against the two 4-bit halves (int8 passes, the default), one process:
# python code_ab.py N K (run from the checkout root)
import sys, time
sys.path.insert(0, "tests")
import numpy as np, torch
from test_gguf_native import random_split_rows
from specdraft.kernels import int8_codes, prompt_pass, tiles
from specdraft.models.gguf_blocks import split_affine, stored_codes
from specdraft.models.quantize import Int4Linear, SplitInt4Linear
torch.set_num_threads(2)
N, K = int(sys.argv[1]), int(sys.argv[2])
raw = torch.from_numpy(random_split_rows("Q8_0", N, K, np.random.default_rng(0)))
new = int8_codes.CodeLinear(lambda a, b: stored_codes(raw[a:b], "Q8_0"), N, K, "Q8_0")
old = SplitInt4Linear(Int4Linear.from_affine(*split_affine(raw, "Q8_0")))
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
for t in (1, 2, 4, 8, 16, 128):
    a = bench(int8(old), t); b = bench(int8(new), t)
    print(f"{N}x{K} tokens {t}: two 4-bit halves (int8) {a:.3f} ms, Q8_0 code tiles {b:.3f} ms ({a/b:.2f}x)")
