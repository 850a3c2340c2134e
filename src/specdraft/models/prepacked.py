"""bf16 linears on oneDNN's prepacked weights: the CPU path of a model loaded unpacked (a Hugging Face
folder, a GGUF file with `--gguf-weights unpacked`).

PyTorch's `nn.Linear` hands oneDNN a plain row-major weight on every call. `PrepackedLinear` reorders
the weight once into oneDNN's own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout
PyTorch's compiler gives CPU linears) and multiplies with `torch.ops.mkldnn._linear_pointwise`. Same
function: its output equals `F.linear`'s bit for bit, and each row is the same whatever the number of
rows in the pass, so a verify pass scores a token exactly as a one-token pass does (tests check both).

Measured (`specdraft costs --gguf-weights unpacked`, AMD EPYC Zen 4, 2 threads, the bundled 1.5B target
in bf16, 300 cached tokens, each way twice, alternated; docs/benchmarks/2026-11-prepacked-linears): a pass over
1 / 2 / 4 / 8 / 16 tokens 244-255 / 209-219 / 229-231 / 257-268 / 328-344 ms on `nn.Linear`, 141-158 /
149-154 / 140-159 / 167-180 / 217-225 ms prepacked.

Set `SPECDRAFT_PREPACK=0` to keep PyTorch's linears (for comparisons).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdraft.kernels import numerics

VARIABLE = numerics.PREPACK_VARIABLE
# oneDNN's kernel for 4 rows beats its kernels for 1 to 3 (Zen 4, 2 threads: 8960x1536 1.19 / 1.25 / 1.10
# against 1.00 ms, the 151936-row head 19.6 / 18.7 / 13.5 against 12.5 ms), so fewer rows are padded to 4.
FAST_ROWS = 4


def available() -> bool:
    """Whether this PyTorch build has oneDNN's bf16 linear on this CPU, and `$SPECDRAFT_PREPACK` is not 0."""
    if not numerics.current().prepack or not torch.backends.mkldnn.is_available():
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported is not None and supported())


class PrepackedLinear(nn.Module):
    """`nn.Linear` (bf16, CPU) whose weight is held in oneDNN's blocked layout, reordered once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:  # weight: [N, K] bf16
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Opaque to PyTorch (no storage): not a parameter; `weight` gives the dense matrix back.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)  # [N]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PrepackedLinear":
        """The same layer, its weight reordered (the linear's own weight can then be freed)."""
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, `[N, K]` bf16: a new copy each time (for code that reads a linear's weight once)."""
        return self.packed.to_dense()

    def num_packed_weights(self) -> int:
        """How many weights the packed matrix holds."""
        return self.out_features * self.in_features

    def opaque_weight_bytes(self) -> int:
        """Bytes of the packed matrix, which PyTorch's parameters and buffers do not show."""
        return self.num_packed_weights() * 2

    def to_linear(self) -> nn.Linear:
        """A plain `nn.Linear` with the same weight and bias."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def __deepcopy__(self, memo: dict) -> "PrepackedLinear":
        return PrepackedLinear(self.weight, None if self.bias is None else copy.deepcopy(self.bias, memo))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] bf16 -> [..., N]
        rows = x.numel() // self.in_features
        if 0 < rows < FAST_ROWS:  # padded with zero rows: the same values for the real ones, sooner
            flat = x.reshape(rows, self.in_features)
            padded = torch.cat([flat, flat.new_zeros(FAST_ROWS - rows, self.in_features)])  # [FAST_ROWS, K]
            out = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:rows]
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _linears(model: nn.Module, kind: type) -> list[tuple[nn.Module, str]]:
    return [(parent, name) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is kind]  # subclasses of nn.Linear may multiply otherwise: left alone


def prepack_linears(model: nn.Module) -> int:
    """Swap each bf16 `nn.Linear` of `model` that lies on the CPU for a `PrepackedLinear`, where
    `available()`; returns how many. Weights shared with other modules (a tied LM head) stay
    where they are too."""
    if not available():
        return 0
    def fits(linear: nn.Linear) -> bool:
        return linear.weight.dtype == torch.bfloat16 and linear.weight.device.type == "cpu"

    # (parent, name) pairs, not the linears: a list holding them would keep every plain weight alive to the end
    swaps = [(parent, name) for parent, name in _linears(model, nn.Linear) if fits(getattr(parent, name))]
    with torch.no_grad():
        for parent, name in swaps:  # one at a time, so each plain weight is freed as soon as it is replaced
            setattr(parent, name, PrepackedLinear.from_linear(getattr(parent, name)))
    return len(swaps)


def unpack_linears(model: nn.Module) -> int:
    """Turn each `PrepackedLinear` of `model` back into a plain `nn.Linear` (before code that needs
    plain weights: training, int4 re-quantization); returns how many."""
    swaps = _linears(model, PrepackedLinear)
    for parent, name in swaps:
        setattr(parent, name, getattr(parent, name).to_linear())
    return len(swaps)
