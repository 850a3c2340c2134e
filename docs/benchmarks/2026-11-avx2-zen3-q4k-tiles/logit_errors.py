# The logit errors of logits.py runs A (16-bit path), B (4-bit tiles, int8 passes), C (Q4_K tiles)
import torch
A, B, C = (torch.load(f"/tmp/q4k/logits{v}.pt") for v in "ABC")
for name, X in (("B int8/32 (old)", B), ("C Q4K int8/256", C)):
    for j in A:
        a, x = A[j], X[j]
        rel0 = ((x[0] - a[0]).norm() / a[0].norm()).item()
        rel = ((x[1:] - a[1:]).norm(dim=-1) / a[1:].norm(dim=-1))
        top = (x[1:].argmax(-1) == a[1:].argmax(-1)).float().mean().item()
        print(f"{name} prompt {j}: pos0 {rel0:.4f}  later median {rel.median():.4f} max {rel.max():.4f}  top1 agree {top:.3f}")
