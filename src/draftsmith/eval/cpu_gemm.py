"""Linear layers whose weights MKL packs once for one row count: the reference decoder's verification on a CPU.

Why. A verification feeds the target k + 1 tokens, so every linear layer is a GEMM over k + 1 rows. In float32
on a CPU, plain `F.linear` over 4-5 rows costs far more than over 1 row although it reads the same weights: on
this project's 2-core Xeon (Emerald Rapids), a SmolLM2-135M-shaped stack of linears took 49-67 ms over 4 rows
against 30-38 ms over 1, while the same products with the weights packed once by MKL for 4 rows took 36 ms.
That gap is most of what kept the reference decoder's speed-up near 1.3x (`benchmarks/cpu_gemm.py` measures it
end to end).

What. `pack_linears` swaps each `nn.Linear` of a model for a `PackedLinear` that keeps the same `weight` and
`bias` parameters (state-dict keys and tied weights unchanged) plus one MKL pack of the weight per row count it
was asked for: the pair of ops Inductor's CPU freezing emits (`torch.ops.mkl._mkl_reorder_linear_weight`,
`torch.ops.mkl._mkl_linear`), built here at load time without compiling anything. A call whose row count has a
pack uses it; any other row count (prefill, a batch that lost rows) and any call that records gradients takes
plain `F.linear`. Both compute the same product; only the summation order may differ.

Scope: CPU, float32 (MKL packs sgemm only), torch built with MKL, inference on fixed weights (a pack is a
snapshot: weights changed afterwards leave it stale). Elsewhere `pack_linears` changes nothing and says why. Each
pack is a copy of the weights, so packing is skipped when the copies would exceed `max_bytes`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackReport:
    """What `pack_linears` did."""

    linears: int
    """Linear layers swapped (0 when skipped)."""
    rows: tuple[int, ...]
    """Row counts each swapped layer holds a pack for."""
    extra_bytes: int
    """Memory the packs take."""
    skipped: str | None = None
    """Why nothing was packed, or None."""

    def line(self) -> str:
        if self.skipped:
            return f"cpu gemm: weights not packed ({self.skipped})"
        return (f"cpu gemm: {self.linears} linear layers packed by MKL for {', '.join(map(str, self.rows))} rows "
                f"({self.extra_bytes / 2**20:,.0f} MiB)")


def mkl_packing_available() -> bool:
    """True where this torch has MKL and the two ops Inductor's CPU freezing uses."""
    mkl = getattr(torch.ops, "mkl", None)
    return (torch.backends.mkl.is_available() and hasattr(mkl, "_mkl_linear")
            and hasattr(mkl, "_mkl_reorder_linear_weight"))


class PackedLinear(torch.nn.Module):
    """`nn.Linear` with MKL packs of its weight for some row counts; the same parameters, the same product."""

    def __init__(self, linear: torch.nn.Linear, rows: Iterable[int]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # (out, in): the same Parameter object, so tied weights stay tied
        self.bias = linear.bias
        w = linear.weight.detach()
        self.packs = {m: torch.ops.mkl._mkl_reorder_linear_weight(w, m) for m in rows}  # not in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (.., in) -> (.., out)
        m = x.numel() // self.in_features  # rows of the product; shape metadata only, no host sync
        pack = self.packs.get(m)
        if pack is None or torch.is_grad_enabled() or x.dtype != torch.float32 or not x.is_cpu:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, pack, self.weight, self.bias, m)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed_rows={sorted(self.packs)}"


def default_max_bytes() -> int:
    """A quarter of physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


def pack_linears(model: torch.nn.Module, rows: Iterable[int], max_bytes: int | None = None) -> PackReport:
    """Swap every `nn.Linear` of a float32 CPU model for a `PackedLinear` holding packs for these row counts.

    Args:
        rows: the row counts (tokens x batch rows) the model's forwards will run at, e.g. {k + 1} for a chain.
        max_bytes: the most memory the packs may take (default: a quarter of physical memory).
    """
    rows = tuple(sorted({int(m) for m in rows if int(m) >= 1}))
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear]
    params = [child.weight for _, _, child in linears]
    skipped = None
    if not rows or not linears:
        skipped = "no row counts" if not rows else "no nn.Linear layers"
    elif not mkl_packing_available():
        skipped = "this torch has no MKL packing ops"
    elif any(p.device.type != "cpu" for p in params):
        skipped = "the model is not on the CPU"
    elif any(p.dtype != torch.float32 for p in params):
        skipped = f"dtype {params[0].dtype}, MKL packs float32 only"
    extra = sum({id(p): p.numel() * 4 for p in params}.values()) * len(rows)
    if skipped is None and extra > (max_bytes if max_bytes is not None else default_max_bytes()):
        skipped = f"the packs would take {extra / 2**30:.1f} GiB, over the limit"
    if skipped:
        return PackReport(linears=0, rows=rows, extra_bytes=0, skipped=skipped)
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child, rows))
    return PackReport(linears=len(linears), rows=rows, extra_bytes=extra)
