"""CUDA kernels of the training path, against plain references (runs on the GPU machine; skipped elsewhere).

Tolerances: bf16 inputs; each check compares our error against the fp32 reference with the error of the
plain bf16 alternative (SDPA), so a wrong gradient (off by far more than rounding) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.drafter import CausalAttentionLSE, causal_attention_lse_reference, ttt_attention, ttt_attention_lse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def qkv(T=512, nh=8, nkv=2, hd=128, steps=3, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n: (torch.randn(1, n, T, hd, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_()  # noqa: E731
    return mk(nh), mk(nkv), mk(nkv), [mk(nkv) for _ in range(steps)], [mk(nkv) for _ in range(steps)]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_causal_attention_lse_values_and_gradients_including_through_lse(backend):
    q, k, v, _, _ = qkv(nkv=8)
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = CausalAttentionLSE.apply(q, k, v, scale, backend)
    ref_out, ref_lse = causal_attention_lse_reference(q.float(), k.float(), v.float(), scale)
    assert rel(out, ref_out) < 2e-2 and rel(lse, ref_lse) < 1e-3
    up_o, up_l = torch.randn_like(ref_out), torch.randn_like(ref_lse)
    ours = torch.autograd.grad((out.float() * up_o).sum() + (lse * up_l).sum(), (q, k, v))
    ref = torch.autograd.grad((ref_out * up_o).sum() + (ref_lse * up_l).sum(), (q, k, v))
    for name, a, b in zip("qkv", ours, ref):
        assert rel(a, b) < 3e-2, f"d{name} off by {rel(a, b):.3g}"


@pytest.mark.parametrize("steps", [1, 6])
def test_lse_merge_on_cuda_is_as_accurate_as_the_summary_key(steps):
    q, k0, v0, dk, dv = qkv(steps=steps)
    leaves = [q, k0, v0, *dk, *dv]
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    ref = ttt_attention_lse(f32[0], f32[1], f32[2], f32[3:3 + steps], f32[3 + steps:],
                            causal=causal_attention_lse_reference)
    up = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * up).sum(), f32)
    results = {}
    for name, fn in (("lse", ttt_attention_lse), ("summary", ttt_attention)):
        out = fn(q, k0, v0, dk, dv)
        grads = torch.autograd.grad((out.float() * up).sum(), leaves)
        results[name] = (rel(out, ref), max(rel(a, b) for a, b in zip(grads, g_ref)))
    (lse_out, lse_grad), (sum_out, sum_grad) = results["lse"], results["summary"]
    assert lse_out < 2 * sum_out + 1e-3 and lse_grad < 2 * sum_grad + 1e-3, results
