"""Decode attention over the rows decoder's static KV cache, each row read only up to its own length (CUDA).

The rows decoder (generation.py) keeps one cache of rows x max_length positions per layer, and its rows sit
at different lengths because finished rows are refilled with new prompts. Dense attention over that cache
(generation's `matmul` and `sdpa` paths) reads every row up to the longest row's bucket and runs the score
work (fp32 cast, mask, softmax) over that whole width: at 2,048 rows that was 12 of the step's 15.5 ms of
kernels on an H200 (benchmarks/results/profile_decode_2048.txt). `row_attention` is one Triton kernel per
layer: a program per (row, kv head) streams that row's keys and values in blocks up to the row's length, with
an online softmax in fp32 (flash-decoding without the split over the sequence: thousands of rows already fill
the GPU), for the g query heads that share the kv head (GQA needs no repeat). Bytes read are the rows' real
lengths, not rows x bucket; nothing of width L is written back.

Shapes: B rows, nh query heads, kvh kv heads, g = nh // kvh, M max_length (cache positions), hd head dim.

Triton is imported with this module, so import it only where a CUDA device runs the decoder
(`generation.resolve_attention`); `reference_row_attention` is the same function in plain torch, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64
"""Cache positions per loop iteration of a program."""


@triton.jit
def _row_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, len_ptr, scale, q_row, kv_row, kv_head,
                          G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                          IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * kv_row passes 2**31 in large caches (4,096 rows x 4,096 positions)
    head = tl.program_id(1)  # the kv head; its query heads are head * G .. head * G + G - 1 (HF repeat_kv order)
    length = tl.load(len_ptr + row)
    g = tl.arange(0, G_PAD)  # tl.dot needs >= 16 rows: the query group is padded with zero rows
    d = tl.arange(0, HD)
    n = tl.arange(0, BLOCK_N)
    q_mask = (g < G)[:, None]
    q_off = row * q_row + (head * G + g)[:, None] * HD + d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # (G_PAD, HD)
    k_base = k_ptr + row * kv_row + head * kv_head
    v_base = v_ptr + row * kv_row + head * kv_head
    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of the scores
    l = tl.zeros([G_PAD], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([G_PAD, HD], tl.float32)  # running sum of exp(score - m) * v
    for start in range(0, length, BLOCK_N):
        pos = start + n
        inside = pos < length
        k = tl.load(k_base + pos[:, None] * HD + d[None, :], mask=inside[:, None], other=0.0)  # (BLOCK_N, HD)
        if IEEE:  # fp32 caches: full fp32 products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(inside[None, :], s * scale, float("-inf"))  # (G_PAD, BLOCK_N) fp32
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max (0 on the first block)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None] * HD + d[None, :], mask=inside[:, None], other=0.0)  # (BLOCK_N, HD)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row of length 0 (inactive) gets zeros
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of one new query per row over that row's first `lengths[b]` cache positions.

    Args:
        q: (B, nh, hd) contiguous queries (RoPE applied).
        keys, values: (B, kvh, M, hd) one layer's cache, contiguous in the last three dims (a layer slice of the
            decoder's (layers, B, kvh, M, hd) cache is).
        lengths: (B,) int, positions each row attends to (0 <= length <= M; 0 gives zeros).
        scale: softmax scale.
    Returns:
        (B, nh * hd) in q's dtype. Graph-safe: no host sync, the grid depends on shapes only.
    """
    B, nh, hd = q.shape
    kvh, M = keys.shape[1], keys.shape[2]
    if keys.stride()[1:] != (M * hd, hd, 1) or values.stride() != keys.stride() or not q.is_contiguous():
        raise ValueError(f"row_attention expects contiguous q and (B, kvh, M, hd) caches with rows of equal stride, "
                         f"got q strides {q.stride()}, keys {keys.stride()}, values {values.stride()}")
    out = torch.empty(B, nh * hd, device=q.device, dtype=q.dtype)
    g = nh // kvh
    _row_attention_kernel[(B, kvh)](q, keys, values, out, lengths, scale, nh * hd, keys.stride(0), M * hd,
                                    G=g, G_PAD=max(16, triton.next_power_of_2(g)), HD=hd, BLOCK_N=BLOCK,
                                    IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out


def reference_row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """`row_attention` in plain torch (float64 inside): the test oracle. Same arguments and result."""
    B, nh, hd = q.shape
    kvh, M = keys.shape[1], keys.shape[2]
    qg = q.double().view(B, kvh, nh // kvh, hd)
    scores = torch.matmul(qg, keys.double().transpose(-1, -2)) * scale  # (B, kvh, g, M)
    visible = torch.arange(M, device=q.device)[None] < lengths[:, None]  # (B, M)
    probs = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, values.double()).reshape(B, nh * hd).to(q.dtype)
