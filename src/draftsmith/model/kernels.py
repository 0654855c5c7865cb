"""The drafter's kernels: TTT attention (causal step-0 keys plus each position's later-step keys) and the
fused draft-head loss (custom autograd), each with the reference it is tested against.

Letters as in drafter.py: B batch, T sequence, H hidden, Vd draft vocab, K TTT steps, nh / nkv heads /
KV heads, g = nh / nkv, hd head dim, i earlier TTT steps.

- `ttt_attention`: the diagonal keys folded into one "summary" key so one causal SDPA call does the whole
  softmax (any device, any dtype);
- `ttt_attention_lse`: the same by merging the causal part's log-sum-exp with the diagonal's (CUDA: keeps
  the flash kernel at the plain head dim; FlexAttention for packed rows' document masks);
- `DraftHeadLoss`: the head, the soft cross-entropy and the argmax of all K steps without keeping any
  (T x Vd) logits.

`drafter.Eagle3Drafter.ttt_step` and `drafter.ttt_forward` call these.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def per_position_product(a: torch.Tensor, b: torch.Tensor, reduce: int) -> torch.Tensor:
    """The diagonal's per-position products: scores "bkgtd,bktjd->bkgtj" (reduce=-1) and values
    "bkgtj,bktjd->bkgtd" (reduce=-2), a (B, nkv, g, T, x), b (B, nkv, T, i, hd). Eager, an einsum (batched
    GEMMs, nothing (g x i x hd) per position materialised). Compiled, a broadcast product summed in fp32, which
    inductor fuses into one kernel per direction: as batched GEMMs these are B x nkv x T products of at most
    (4 x 128) by (128 x 7), which cuBLAS runs at a fraction of its rate (4.4 ms of a packed Llama-3.1-8B step on
    an H100, 2026-12-06 profile, against some 0.1 GB of data per step to read). Returns at least fp32."""
    acc = torch.promote_types(a.dtype, torch.float32)
    if not torch.compiler.is_compiling():
        eq = "bkgtd,bktjd->bkgtj" if reduce == -1 else "bkgtj,bktjd->bkgtd"
        return torch.einsum(eq, a, b.to(a.dtype)).to(acc)
    if reduce == -1:
        return (a.unsqueeze(-2).to(acc) * b.unsqueeze(2).to(acc)).sum(-1)  # (B, nkv, g, T, i)
    return (a.unsqueeze(-1).to(acc) * b.unsqueeze(2).to(acc)).sum(-2)  # (B, nkv, g, T, hd)


def diagonal_scores(q: torch.Tensor, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's scores against its own index's keys of TTT steps 1..i, per KV group (K/V not repeated
    per query head). Returns (d (B, nkv, g, T, i) in at least fp32, the stacked values (B, nkv, T, i, hd))."""
    B, nh, T, hd = q.shape
    dk = torch.stack(diag_k, dim=-2)  # (B, nkv, T, i, hd)
    qg = q.view(B, dk.shape[1], nh // dk.shape[1], T, hd)
    d = per_position_product(qg, dk, reduce=-1) * scale
    return d, torch.stack(diag_v, dim=-2)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                  diag_v: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over step-0 keys plus, per position, that position's keys of later steps.

    Without a (T x T*K) matrix: for query t the diagonal keys contribute mass sum_j exp(d_tj) and value
    sum_j exp(d_tj) v_jt. Both are folded into one extra key placed before position 0 and visible to
    every query: its score is a_t = logsumexp_j d_tj (carried by an extra query channel against a key
    channel of 1), its value a one-hot channel. One causal SDPA call then normalises over everything;
    the one-hot channel of the output is the diagonal's share p_t, and the diagonal's contribution is
    p_t * softmax_j(d_tj) v_jt. a_t is split into a high and a low part so bf16 inputs keep it exact.

    Args:
        q: (B, nh, T, hd); k0, v0: (B, nkv, T, hd); diag_k, diag_v: lists of (B, nkv, T, hd);
        mask: packed rows' step-0 mask, as (B, 1, T, T) bool (`document_mask`) or as each row's document spans
            (`document_spans`, run one document at a time); None: plain causal.
    Returns:
        (B, nh, T, hd).
    """
    if isinstance(mask, DocumentSpans):
        return per_document(q, k0, v0, diag_k, diag_v, mask)
    B, nh, T, hd = q.shape
    nkv = k0.shape[1]
    groups = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    if not diag_k:
        return F.scaled_dot_product_attention(q, k0, v0, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=groups > 1)
    d, dv = diagonal_scores(q, diag_k, diag_v, scale)  # (B, nkv, g, T, i), (B, nkv, T, i, hd)
    acc = d.dtype
    a = torch.logsumexp(d, dim=-1).reshape(B, nh, T)  # (B, nh, T)
    a_hi = a.to(q.dtype).to(acc)
    a_lo = a - a_hi
    pad = 8 - (hd % 8) if hd % 8 else 8  # room for 2 channels; keep the head dim a multiple of 8
    # Queries: [q, a_hi/scale, a_lo/scale, 0...], with one dummy query row in front (dropped below).
    q_ext = torch.cat([q, (torch.stack([a_hi, a_lo], -1) / scale).to(q.dtype), q.new_zeros(B, nh, T, pad - 2)], -1)
    q_ext = F.pad(q_ext, (0, 0, 1, 0))  # (B, nh, T+1, hd+pad)
    k_ext = F.pad(k0, (0, pad, 1, 0))  # (B, nkv, T+1, hd+pad): summary key at index 0, zeros for now
    k_ext[:, :, 0, hd:hd + 2] = 1.0
    v_ext = F.pad(v0, (0, pad, 1, 0))
    v_ext[:, :, 0, hd] = 1.0
    # The summary key (index 0) is visible to every query; with documents, the dummy query row sees all keys.
    mask_ext = None if mask is None else F.pad(mask, (1, 0, 1, 0), value=True)  # (B, 1, T+1, T+1)
    out = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, attn_mask=mask_ext, is_causal=mask is None, scale=scale,
                                         enable_gqa=groups > 1)[:, :, 1:]  # (B, nh, T, hd+pad)
    share = out[..., hd:hd + 1]  # (B, nh, T, 1): the diagonal keys' total probability
    diag = per_position_product(torch.softmax(d, -1).to(q.dtype), dv, reduce=-2).reshape(B, nh, T, hd)
    return out[..., :hd] + share * diag.to(q.dtype)


class CausalAttentionLSE(torch.autograd.Function):
    """Causal flash attention (CUDA, cuDNN or FlashAttention-2 kernels) returning its log-sum-exp too,
    differentiable in both.

    The kernels' backward forms dS = P (dP - D) with D_i = dO_i . O_i and has no input for a gradient g
    of lse_i = logsumexp_j S_ij, which adds g_i P_ij to dS_ij. D_i only enters through O, so the backward
    is handed O'_i = O_i - (g_i / |dO_i|^2) dO_i, for which dO_i . O'_i = D_i - g_i. In `ttt_attention_lse`
    g_i = (1 - w_i)(O_i - Od_i) . dO_i, so the correction is at most (1 - w_i)|O_i - Od_i|: O' stays of
    the size of the values and its bf16 rounding costs what O's own does.

    Args: q (B, nh, T, hd), k, v (B, nh, T, hd) (K/V repeated to nh heads), scale, backend "cudnn" or "flash".
    Returns: (out (B, nh, T, hd), lse (B, nh, T) fp32, natural log).
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, backend="cudnn"):
        if backend == "cudnn":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, True, False, scale=scale)
        else:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.cum, ctx.max_q, ctx.max_k, ctx.scale, ctx.backend = (cum_q, cum_k), max_q, max_k, scale, backend
        B, nh, T, _ = q.shape
        return out, lse.view(B, nh, T)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        if d_lse is not None:
            do = d_out.float()
            norm = do.square().sum(-1, keepdim=True)
            c = torch.where(norm > 0, d_lse.float()[..., None] / norm.clamp(min=1e-30), 0.0)
            out = (out.float() - c * do).to(out.dtype)
        cum_q, cum_k = ctx.cum
        if ctx.backend == "cudnn":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                d_out.contiguous(), q, k, v, out, lse, seed, offset, None, cum_q, cum_k, ctx.max_q, ctx.max_k,
                0.0, True, scale=ctx.scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                d_out.contiguous(), q, k, v, out, lse, cum_q, cum_k, ctx.max_q, ctx.max_k, 0.0, True, seed, offset,
                scale=ctx.scale)
        return dq, dk, dv, None, None


def causal_attention_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                   mask: torch.Tensor | None = None):
    """`CausalAttentionLSE` the plain way (any device, autograd through everything): for tests and CPU.
    mask: (B, 1, T, T) bool (`document_mask`) instead of plain causal."""
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, -math.inf)
    return (torch.softmax(s, -1).to(v.dtype) @ v), torch.logsumexp(s, -1)


# --- Packed rows: document masks ------------------------------------------------------------------------
# A packed row holds several documents (whole conversations, or pieces of a long one) back to back;
# `documents` (B, T) numbers them per row. Positions restart at each document and a query sees the step-0
# keys of its own document only. The diagonal keys of later steps sit at the query's own index, so they
# are inside its document by construction.

try:  # torch >= 2.9 asks for the log-sum-exp through return_aux; earlier versions through return_lse
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """Where each document of a row starts: a change of document number, or the row's first token. (B, T) bool."""
    return F.pad(documents[:, 1:] != documents[:, :-1], (1, 0), value=True)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """RoPE positions that restart at 0 where each document of a row starts. (B, T) -> (B, T) int64"""
    B, T = documents.shape
    index = torch.arange(T, device=documents.device).expand(B, T)
    return index - torch.where(document_starts(documents), index, 0).cummax(dim=1).values


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Step-0 attention of packed rows as a dense mask: key s visible to query t iff s <= t in t's document.
    (B, T) -> (B, 1, T, T) bool (for SDPA; the CPU path)."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


class DocumentSpans(NamedTuple):
    """Packed rows' documents as index ranges: rows[b] lists row b's (start, end) spans, in order, covering it."""
    rows: tuple[tuple[tuple[int, int], ...], ...]


def document_spans(documents: torch.Tensor) -> DocumentSpans:
    """Each row's document spans, read on the host (one copy of the start flags' indices, no per-token Python):
    the eager CPU path attends one document at a time, the sum of the documents' squared lengths, where a dense
    `document_mask` costs T^2 per row (packed rows of 4096 on the CPU: 0.24x the unpacked rate under the dense
    mask, 0.95x per document; docs/gpu.md, "Packed rows on the CPU"). A span is a run of one document number, as
    `features.pack_rows` numbers each row (0, 1, ... in order, then the padding). (B, T) -> DocumentSpans."""
    B, T = documents.shape
    rows: list[list[int]] = [[] for _ in range(B)]
    for b, t in document_starts(documents).nonzero().tolist():  # row-major: each row's starts in order
        rows[b].append(t)
    return DocumentSpans(tuple(tuple(zip(r, r[1:] + [T])) for r in rows))


def per_document(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                 diag_v: list[torch.Tensor], spans: DocumentSpans) -> torch.Tensor:
    """`ttt_attention`, plain causal, over each document of each row alone, put back in place: the same as under
    `document_mask`, since no query sees a key outside its document and the diagonal keys are per position. One
    call per document: batching documents of similar length (padded) into one call measured
    no faster on the CPU (bench_packing.py). Shapes as `ttt_attention`'s; returns (B, nh, T, hd)."""
    lengths = [[end - start for start, end in row] for row in spans.rows]

    def parts(x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """x's documents, [row][document] (1, heads, length, hd): views whose backward is one cat (a slice's would
        write its gradient into zeros of x's whole size, once per document)."""
        return [row.split(n, dim=2) for row, n in zip(x.split(1, dim=0), lengths)]

    q_, k_, v_ = parts(q), parts(k0), parts(v0)
    dk_, dv_ = [parts(x) for x in diag_k], [parts(x) for x in diag_v]
    rows = [torch.cat([ttt_attention(q_[b][d], k_[b][d], v_[b][d], [x[b][d] for x in dk_], [x[b][d] for x in dv_])
                       for d in range(len(n))], dim=2) for b, n in enumerate(lengths)]
    return torch.cat(rows, dim=0)


FLEX_BLOCK = 128  # FlexAttention's default sparse block size (query and key blocks)


def document_block_mask(documents: torch.Tensor):
    """The same mask as a FlexAttention `BlockMask` (the CUDA path: blocks outside every document are skipped).

    Built from each block's range of document numbers, (B, T/128, T/128) work, rather than by
    `create_block_mask`, which evaluates the mask at all T x T positions through vmap (2.8 ms of host time a
    step at T 4096 on the H200). A key block below the diagonal is full where it and the query block hold one
    and the same document; a block on the diagonal, or whose range of documents meets the query block's, is
    partial (the mask decides per position); any other is skipped. For rows whose documents are contiguous
    runs, as packing makes them, these are `create_block_mask`'s blocks exactly (a test); for any other
    numbering the ranges over-cover, which costs time, never correctness. A length that is not a multiple of
    the block size goes through `create_block_mask`."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    B, T = documents.shape
    if T % FLEX_BLOCK:
        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device)
    blocks = documents.view(B, T // FLEX_BLOCK, FLEX_BLOCK)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)  # (B, n): each block's document range
    n = T // FLEX_BLOCK
    below = torch.ones(n, n, dtype=torch.bool, device=documents.device).tril(-1)  # key block j < query block i
    meets = (low[:, None, :] <= high[:, :, None]) & (high[:, None, :] >= low[:, :, None])  # (B, i, j)
    single = low == high
    full = below & (single[:, :, None] & single[:, None, :]) & (low[:, :, None] == low[:, None, :])
    partial = meets & (below | torch.eye(n, dtype=torch.bool, device=documents.device)) & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 1, n) counts and (B, 1, n, n) key-block indices, the set ones first in ascending order."""
        counts = dense.sum(dim=-1, dtype=torch.int32)
        indices = torch.argsort(~dense, dim=-1, stable=True).to(torch.int32)
        return counts[:, None], indices[:, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=same_document_causal)


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float, lse: bool):
    """FlexAttention under a block mask: out (B, nh, T, hd), and with lse=True also lse (B, nh, T) fp32 natural
    log, differentiable (its backward takes the lse gradient). Compiled on CUDA, unless already inside a
    compiled region (`compile_for_training`), which compiles it itself; eager flex materialises the scores and
    serves the CPU tests, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        fn = compiled_flex_attention()
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if not lse:
        return fn(q, k, v, **kwargs)
    if AuxRequest is not None:
        out, aux = fn(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fn(q, k, v, return_lse=True, **kwargs)


def is_block_mask(mask) -> bool:
    """Whether `mask` is FlexAttention's `BlockMask` (without importing it): not None, a dense mask or spans."""
    return mask is not None and not isinstance(mask, (torch.Tensor, DocumentSpans))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, nkv, T, hd) -> (B, nkv * groups, T, hd): each KV head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, 1)


def ttt_attention_lse(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                      diag_v: list[torch.Tensor], causal=None, mask=None,
                      causal_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`ttt_attention` by merging log-sum-exps: the causal part at the plain head dim, the diagonal added after.

    out = w o0 + (1 - w) od, with o0, lse0 the causal attention over step 0's keys, od the softmax-weighted
    diagonal values, a = logsumexp of the diagonal scores, and w = exp(lse0 - logaddexp(lse0, a)). On CUDA
    this keeps the flash kernel at head dim 128 (the summary key of `ttt_attention` makes it 136, which
    ran 2x slower fwd + bwd on an H200: benchmarks/results/gpu_attention.json).

    Args: as `ttt_attention`; causal: (q, k, v, scale) -> (out, lse) with k/v at nh heads; defaults to
        `CausalAttentionLSE` on CUDA and the plain reference elsewhere, or, for packed rows, to FlexAttention
        under `mask` when it is a `BlockMask` (`document_block_mask`; K/V stay at nkv heads, the kernel
        groups them) and the reference under `mask` when it is a dense (B, 1, T, T) mask (`document_mask`);
        causal_kv: k0, v0 already repeated to nh heads (`repeat_kv`): the unroll repeats them once for all
        its steps (one copy kept for the backward instead of one per step).
    Returns: (B, nh, T, hd).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not diag_k:  # step 0: plain (document-) causal attention
        if is_block_mask(mask):
            return flex(q, k0, v0, mask, scale, lse=False)
        return ttt_attention(q, k0, v0, diag_k, diag_v, mask)
    B, nh, T, hd = q.shape
    groups = nh // k0.shape[1]
    if causal is None and is_block_mask(mask):
        out0, lse0 = flex(q, k0, v0, mask, scale, lse=True)  # (B, nh, T, hd), (B, nh, T)
    else:
        if causal is None and mask is not None:
            causal = lambda q_, k_, v_, s_: causal_attention_lse_reference(q_, k_, v_, s_, mask)  # noqa: E731
        elif causal is None:
            causal = CausalAttentionLSE.apply if q.is_cuda else causal_attention_lse_reference
        k_rep, v_rep = causal_kv or (repeat_kv(k0, groups), repeat_kv(v0, groups))
        out0, lse0 = causal(q, k_rep, v_rep, scale)
    d, dv = diagonal_scores(q, diag_k, diag_v, scale)  # (B, nkv, g, T, i), (B, nkv, T, i, hd)
    acc = d.dtype
    lse0 = lse0.reshape(B, nh, T).to(acc)
    a = torch.logsumexp(d, dim=-1).reshape(B, nh, T)  # (B, nh, T)
    m = torch.logaddexp(lse0, a)
    w = torch.exp(lse0 - m)[..., None]  # (B, nh, T, 1): the causal keys' share
    probs = torch.softmax(d, -1) * torch.exp(a - m).view(d.shape[:-1] + (1,))  # (B, nkv, g, T, i)
    diag = per_position_product(probs.to(q.dtype), dv, reduce=-2).reshape(B, nh, T, hd)
    return (w * out0.to(acc) + diag).to(q.dtype)


# --- The fused draft-head loss ---------------------------------------------------------------------------


def soft_ce_rows(z: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Soft cross-entropy per row, its gradient and the row's argmax, from the logits in one read.

    ce = -sum_v p_v log softmax(z)_v = s lse(z) - sum_v p_v z_v with s = sum_v p_v (the target's mass inside
    the draft vocabulary); d(sum_r w_r ce_r)/dz = w (s softmax(z) - p). Pure elementwise and row reductions:
    under torch.compile (`compile_for_training`) it becomes a couple of kernels that read z and p once each.

    Args: z (..., Vd) logits; p (..., Vd) target probabilities; w (...) row weights.
    Returns: (ce (...) fp32, grad (..., Vd) in z's dtype, argmax (...) int64).
    """
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    top = zf.max(dim=-1)
    e = torch.exp(zf - top.values[..., None])
    sum_e = e.sum(-1)
    s = p.sum(-1)
    ce = s * (top.values + sum_e.log()) - (p * zf).sum(-1)
    grad = (e * (s / sum_e)[..., None] - p) * w[..., None]
    return ce, grad.to(z.dtype), top.indices


def hard_ce_rows(z: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`soft_ce_rows` for one label per row: ce = lse(z) - z_label, d(sum_r w_r ce_r)/dz = w (softmax(z) - onehot).

    Args: z (..., V) logits; labels (...) int64 (any id where w is 0); w (...) row weights.
    Returns: (ce (...) fp32, grad (..., V) in z's dtype, argmax (...) int64).
    """
    zf = z.to(torch.promote_types(z.dtype, torch.float32))
    top = zf.max(dim=-1)
    e = torch.exp(zf - top.values[..., None])
    sum_e = e.sum(-1)
    picked = zf.gather(-1, labels[..., None]).squeeze(-1)
    ce = top.values + sum_e.log() - picked
    grad = (e * (w / sum_e)[..., None]).scatter_add(-1, labels[..., None], -w[..., None].to(e.dtype))
    return ce, grad.to(z.dtype), top.indices


HEAD_GEMM_ROWS = 16384
"""`DraftHeadLoss` runs the gradient GEMMs of as many TTT steps together as fit this many rows (4 steps at
T = 4096): large GEMMs, and a gradient buffer of at most rows x Vd (1 GB at Vd = 32k in bf16)."""


class DraftHeadLoss(torch.autograd.Function):
    """The draft head, its soft cross-entropy and its argmax for all K TTT steps in one function.

    loss = sum_i sum_r w_ir ce_ir, logits z_i = x_i W^T. The (rows x Vd) logits live only inside the
    forward, one step at a time: it computes the loss, the argmax and, while z_i is at hand, its gradient
    g_i. The gradients of x and W are then GEMMs over groups of steps (`HEAD_GEMM_ROWS`; W's: G^T X
    accumulated over the group's rows inside one GEMM, instead of one product per step summed in more
    passes); nothing of size (rows x Vd) is kept for the backward, which only scales the two gradients
    by the incoming one.

    Args: x (K, B, T, H) the normed hidden state of every step, in the compute dtype; weight (Vd, H) the
        head (any dtype; cast to x's); p (B, T+K, Vd) target probabilities, step i reading rows
        [1+i, 1+i+T) (not differentiated); w (K, B, T) row weights (decay^i / denominator where
        supervised, 0 elsewhere; not differentiated); rows: `soft_ce_rows` (compiled with the rest of the forward
        under `drafter.compile_for_training`).
        group_rows: the rows (B x T) the grouping is sized for, if not this batch's: the most any micro-batch
        of the run has, so that every micro-batch groups its steps alike (a compiled step with dynamic shapes
        then compiles once, not once per grouping: each costs a minute at Llama-3.1-8B shapes).
    Returns: (loss () fp32, ce (K, B, T) fp32 unweighted, argmax (K, B, T) int64); only loss is differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, p, w, rows, group_rows=None):
        K, B, T, H = x.shape
        W = weight.to(x.dtype)
        Vd = W.shape[0]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = x.new_empty(K, B, T, H) if need_x else None
        gw, acc = None, torch.promote_types(x.dtype, torch.float32)  # W's gradient summed in at least fp32
        group = max(1, HEAD_GEMM_ROWS // (group_rows or B * T))  # steps whose gradient GEMMs run as one
        ce, top = [], []
        # Compiled, the group's gradients are stacked: inductor then writes each step's gradient kernel straight
        # into its slice of G. Item assignment into one buffer (the eager path, which never holds two copies)
        # becomes a chain of select_scatters there, one more pass over all of G per step.
        want_g = need_x or need_w
        stacked = want_g and torch.compiler.is_compiling()
        for i0 in range(0, K, group):
            n = min(group, K - i0)
            G = x.new_empty(n, B, T, Vd) if want_g and not stacked else None  # (n, B, T, Vd)
            gs = []
            for j in range(n):
                i = i0 + j
                ce_i, g_i, top_i = rows(x[i] @ W.T, p[:, 1 + i:1 + i + T], w[i])  # (B, T), (B, T, Vd), (B, T)
                if stacked:
                    gs.append(g_i)
                elif G is not None:
                    G[j] = g_i
                ce.append(ce_i)
                top.append(top_i)
            if stacked:
                G = torch.stack(gs)  # (n, B, T, Vd)
                del gs
            if need_x:
                gx[i0:i0 + n] = G @ W  # (n, B, T, H)
            if need_w:
                part = G.view(-1, Vd).T @ x[i0:i0 + n].reshape(-1, H)  # (Vd, H) in x's dtype
                if gw is None:
                    gw = part.to(acc)
                else:  # in place: no third (Vd, H) buffer at the loss's memory peak
                    gw.add_(part)
            del G
        ce, top = torch.stack(ce), torch.stack(top)
        ctx.save_for_backward(gx, gw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, top)
        return (ce * w).sum(), ce, top

    @staticmethod
    def backward(ctx, grad, _ce, _top):
        gx, gw = ctx.saved_tensors
        return (gx * grad if gx is not None else None,
                (gw * grad).to(ctx.weight_dtype) if gw is not None else None, None, None, None, None)


# --- The MLP's gated product, recomputed in the backward ---------------------------------------------------


class SwiGLUDown(torch.autograd.Function):
    """y = down(silu(g) * u) from the gate and up projections g, u (..., I), keeping only g and u for the
    backward: the product a = silu(g) * u (input of the down projection's weight gradient) and silu(g) are
    recomputed there instead of saved. Autograd through the plain expression keeps g, silu(g), u and a, four
    (T x I) tensors per TTT step (I = 14,336 at Llama-3.1-8B: 117 MB each at T = 4096 in bf16); this keeps two.

    Args: g, u (..., I) in the compute dtype; weight (H, I) the down projection (cast to g's dtype).
    Returns: y (..., H) in g's dtype.
    """

    @staticmethod
    def forward(ctx, g, u, weight):
        w = weight.to(g.dtype)
        ctx.save_for_backward(g, u, w)
        ctx.weight_dtype = weight.dtype
        return F.linear(F.silu(g) * u, w)

    @staticmethod
    def backward(ctx, dy):
        g, u, w = ctx.saved_tensors
        dy = dy.to(g.dtype)
        sig = torch.sigmoid(g)
        silu = g * sig
        da = dy @ w  # (..., I)
        dw = dy.reshape(-1, dy.shape[-1]).T @ (silu * u).reshape(-1, g.shape[-1])  # (H, I)
        dg = da * u * (sig * (1 + g * (1 - sig)))
        du = da * silu
        return dg, du, dw.to(ctx.weight_dtype)
