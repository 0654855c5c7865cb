"""The EAGLE-3 drafter (Li et al., arXiv 2503.01840), in paper order, with training-time test.

Letters: B batch, T sequence, H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab,
K TTT steps, nh / nkv heads / KV heads, hd head dim, I MLP width.

    a = cat(aux_low, aux_mid, aux_high)        (B, T, 3Ht)   from the target
    h = fc(a)                                  (B, T, H)
    e = embed_tokens(next token)               (B, T, H)     frozen copy of the target's
    x = cat(input_layernorm(e), hidden_norm(h))  (B, T, 2H)  embedding first
    h = h + o_proj(attn(q, k, v of x))         residual is the un-normed h
    h = h + mlp(post_attention_layernorm(h))   SwiGLU
    logits = lm_head(norm(h))                  (B, T, Vd)    h (pre-norm) is fed back for the next step

Attribute names are the checkpoint keys of the `LlamaForCausalLMEagle3` layout that vLLM
(`llama_eagle3.py`) and SGLang load: `fc`, `midlayer.{hidden_norm, input_layernorm, self_attn.*,
post_attention_layernorm, mlp.*}`, `norm`, `lm_head`, buffers `d2t`, `t2d`. `embed_tokens` is not
exported (engines share the target's).

Training-time test (reference/training.md §4): step 0 starts from fc(aux); step i > 0 is fed the
previous step's pre-norm output and the ground-truth token one further; queries of step i sit at RoPE
position t + i; keys of step 0 are causal over the sequence and keys of steps 1..i are visible only at
the same index t (the diagonal). `ttt_attention` computes exactly that without a (T x T*K) score
matrix: the diagonal keys are folded into one extra "summary" key, so a single causal SDPA call does
the whole softmax (see its docstring); on CUDA `ttt_attention_lse` computes the same by merging the
causal part's log-sum-exp with the diagonal's, which keeps the flash kernel at the plain head dim.
`ttt_forward` also projects the embedding half of q/k/v once per unroll, and `DraftHeadLoss` runs the
head, the loss and the argmax of all steps without keeping any (T x Vd) logits. Packed rows (several
documents per row, `documents`) restart positions per document and keep step-0 attention inside it:
a dense mask for SDPA on CPU, a FlexAttention block mask on CUDA (see "Packed rows" below).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from draftsmith.target import TargetSpec


@dataclass(frozen=True)
class DrafterConfig:
    """Shapes and flags of a drafter; derived from the target by `from_target`."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """Target vocabulary V (embedding rows, t2d length)."""
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, int, int]
    """Boundary indices into the target's `output_hidden_states` (DESIGN.md, "Conventions")."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    """False: the residual is the un-normed fc output (EAGLE / SpecForge / SGLang); True: speculators."""

    @classmethod
    def from_target(cls, spec: TargetSpec, draft_vocab_size: int, aux_layer_ids: tuple[int, int, int]) -> DrafterConfig:
        """A one-layer dense Llama drafter of the target's hidden size.

        GQA targets keep their head layout. MLA targets (DeepSeek-V3, Kimi-K2) get a dense Llama layer
        with head_dim 128 and as many KV heads as query heads (the layout of public Kimi drafters,
        reference/training.md §7.6).
        """
        if spec.is_mla:
            head_dim = 128
            heads = max(1, spec.hidden_size // head_dim)
            kv_heads = heads
        else:
            head_dim, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
        return cls(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=spec.vocab_size,
                   draft_vocab_size=draft_vocab_size, target_hidden_size=spec.hidden_size,
                   target_num_layers=spec.num_layers, aux_layer_ids=tuple(aux_layer_ids),
                   rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                   max_position_embeddings=spec.max_position_embeddings)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        d = dict(d)
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return cls(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # at least fp32 (float64 stays float64)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (..., hd) for integer positions (...,) ((T,) or (B, T)), Llama's half-rotation layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (..., hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., hd)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, hd) rotated by position."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concatenation of embedding and hidden state."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (B, nh, T, hd), k and v (B, nkv, T, hd), RoPE applied to q and k."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections (B, T, n hd) -> q (B, nh, T, hd), k and v (B, nkv, T, hd), RoPE applied to q and k."""
        B, T, _ = q.shape
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The drafter's single decoder layer (checkpoint prefix `midlayer.`)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def attention_input(self, e: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x = cat(norm(e), norm(h)) (B, T, 2H) and the residual (B, T, H)."""
        hn = self.hidden_norm(h)
        residual = hn if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(e), hn], dim=-1), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Residual add, then the MLP block: the pre-norm output h (B, T, H)."""
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class StepCache:
    """Keys and values of earlier TTT steps (steps 1..i), for the diagonal. Each (B, nkv, T, hd)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


def diagonal_scores(q: torch.Tensor, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor],
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's scores against its own index's keys of TTT steps 1..i, per KV group (K/V not repeated
    per query head). Returns (d (B, nkv, g, T, i) in at least fp32, the stacked values (B, nkv, T, i, hd))."""
    B, nh, T, hd = q.shape
    dk = torch.stack(diag_k, dim=-2)  # (B, nkv, T, i, hd)
    qg = q.view(B, dk.shape[1], nh // dk.shape[1], T, hd)
    d = torch.einsum("bkgtd,bktjd->bkgtj", qg, dk).to(torch.promote_types(q.dtype, torch.float32)) * scale
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
        mask: packed rows' step-0 mask (B, 1, T, T) bool (`document_mask`); None: plain causal.
    Returns:
        (B, nh, T, hd).
    """
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
    diag = torch.einsum("bkgtj,bktjd->bkgtd", torch.softmax(d, -1).to(q.dtype), dv).reshape(B, nh, T, hd)
    return out[..., :hd] + share * diag


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


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """RoPE positions that restart at 0 where each document of a row starts. (B, T) -> (B, T) int64"""
    B, T = documents.shape
    index = torch.arange(T, device=documents.device).expand(B, T)
    starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0), value=True)  # (B, T)
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Step-0 attention of packed rows as a dense mask: key s visible to query t iff s <= t in t's document.
    (B, T) -> (B, 1, T, T) bool (for SDPA; the CPU path)."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def document_block_mask(documents: torch.Tensor):
    """The same mask as a FlexAttention `BlockMask` (the CUDA path: blocks outside every document are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    B, T = documents.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=documents.device)


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
    return mask is not None and not isinstance(mask, torch.Tensor)


def ttt_attention_lse(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                      diag_v: list[torch.Tensor], causal=None, mask=None) -> torch.Tensor:
    """`ttt_attention` by merging log-sum-exps: the causal part at the plain head dim, the diagonal added after.

    out = w o0 + (1 - w) od, with o0, lse0 the causal attention over step 0's keys, od the softmax-weighted
    diagonal values, a = logsumexp of the diagonal scores, and w = exp(lse0 - logaddexp(lse0, a)). On CUDA
    this keeps the flash kernel at head dim 128 (the summary key of `ttt_attention` makes it 136, which
    ran 2x slower fwd + bwd on an H200: benchmarks/results/gpu_attention.json).

    Args: as `ttt_attention`; causal: (q, k, v, scale) -> (out, lse) with k/v at nh heads; defaults to
        `CausalAttentionLSE` on CUDA and the plain reference elsewhere, or, for packed rows, to FlexAttention
        under `mask` when it is a `BlockMask` (`document_block_mask`) and the reference under `mask` when it
        is a dense (B, 1, T, T) mask (`document_mask`).
    Returns: (B, nh, T, hd).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not diag_k:  # step 0: plain (document-) causal attention
        if is_block_mask(mask):
            return flex(q, k0, v0, mask, scale, lse=False)
        return ttt_attention(q, k0, v0, diag_k, diag_v, mask)
    B, nh, T, hd = q.shape
    groups = nh // k0.shape[1]
    if causal is None:
        if is_block_mask(mask):
            causal = lambda q_, k_, v_, s_: flex(q_, k_, v_, mask, s_, lse=True)  # noqa: E731
        elif mask is not None:
            causal = lambda q_, k_, v_, s_: causal_attention_lse_reference(q_, k_, v_, s_, mask)  # noqa: E731
        else:
            causal = CausalAttentionLSE.apply if q.is_cuda else causal_attention_lse_reference
    out0, lse0 = causal(q, k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1), scale)
    d, dv = diagonal_scores(q, diag_k, diag_v, scale)  # (B, nkv, g, T, i), (B, nkv, T, i, hd)
    acc = d.dtype
    lse0 = lse0.reshape(B, nh, T).to(acc)
    a = torch.logsumexp(d, dim=-1).reshape(B, nh, T)  # (B, nh, T)
    m = torch.logaddexp(lse0, a)
    w = torch.exp(lse0 - m)[..., None]  # (B, nh, T, 1): the causal keys' share
    probs = torch.softmax(d, -1) * torch.exp(a - m).view(d.shape[:-1] + (1,))  # (B, nkv, g, T, i)
    diag = torch.einsum("bkgtj,bktjd->bkgtd", probs.to(q.dtype), dv).reshape(B, nh, T, hd)
    return (w * out0.to(acc) + diag.to(acc)).to(q.dtype)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. Buffers d2t (Vd,) int64 and t2d (V,) bool map draft ids to target ids."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.soft_ce_rows = soft_ce_rows  # the loss's elementwise pass; `compile_for_training` swaps in a compiled copy

    def ttt_step(self, e_qkv: torch.Tensor, h: torch.Tensor, w_h: torch.Tensor, positions: torch.Tensor,
                 cache: StepCache, first: bool, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One TTT step over the whole sequence, up to the final norm (the head runs in `DraftHeadLoss`).

        The q/k/v projection of x = cat(input_layernorm(e), hidden_norm(h)) is split by linearity into
        the embedding half, e_qkv, which is the same at every step up to a shift of one token and is
        projected once per unroll (`ttt_forward`), and the hidden half, projected here with w_h.

        Args:
            e_qkv: (B, T, (nh + 2 nkv) hd) the embedding half of q/k/v for the tokens fed at this step;
            h: (B, T, H) hidden state fed at this step; w_h: ((nh + 2 nkv) hd, H) the hidden half of the
            q/k/v weights; positions: (T,) or, for packed rows, (B, T) RoPE positions of this step's queries
            and keys; cache: keys and values of steps 0..i-1; `first` marks step 0 (whose keys become the
            causal keys); mask: packed rows' step-0 mask (`document_mask` / `document_block_mask`) or None.
        Returns:
            (norm(h_out) (B, T, H) in h's dtype, the head's input; h_out (B, T, H) pre-norm, fed to the next step).
        """
        mid, attn_mod = self.midlayer, self.midlayer.self_attn
        hn = mid.hidden_norm(h)
        residual = hn if mid.norm_before_residual else h
        qkv = e_qkv + F.linear(hn, w_h)  # (B, T, (nh + 2 nkv) hd)
        B, T, _ = qkv.shape
        nq, nk = attn_mod.nh * attn_mod.hd, attn_mod.nkv * attn_mod.hd
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (T, hd) or (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd): per-row positions, broadcast over heads
        q, k, v = attn_mod.heads(*qkv.split([nq, nk, nk], dim=-1), cos.to(qkv.dtype), sin.to(qkv.dtype))
        if first:
            cache.keys, cache.values = [k], [v]
        else:
            cache.keys.append(k)
            cache.values.append(v)
        # The same math; each the faster where it runs (flash kernels take half precision only; packed rows on
        # CUDA go through FlexAttention's block mask, any dtype).
        lse = q.is_cuda and (mask is not None or q.dtype in (torch.bfloat16, torch.float16))
        attention = ttt_attention_lse if lse else ttt_attention
        attn = attention(q, cache.keys[0], cache.values[0], cache.keys[1:], cache.values[1:],
                         mask=mask)  # (B, nh, T, hd)
        attn = attn_mod.o_proj(attn.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)
        h_out = mid.finish(attn, residual)
        return self.norm(h_out).to(h_out.dtype), h_out

    def forward(self, *args, **kwargs) -> TTTOutput:
        """The training forward: a TTT unroll (`ttt_forward`). DDP wraps this, so training calls the module."""
        return ttt_forward(self, *args, **kwargs)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# --- Training-time test -------------------------------------------------------------------------------

TTT_STEPS = 7  # EAGLE-3 trainer (SafeAILab/EAGLE traineagle3 `self.length = 7`); SpecForge default
TTT_STEP_LOSS_DECAY = 0.8  # EAGLE-3 paper; SafeAILab/EAGLE traineagle3/main.py `ploss_weight`, SpecForge


@dataclass(frozen=True)
class TTTOutput:
    """Result of one TTT unroll over a batch.

    loss: weighted loss to backpropagate (scalar). Per step i (K,): loss_sum, correct, count.
    correct / valid: (K, B, T) bool, for acceptance simulation.
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor

    @property
    def count(self) -> torch.Tensor:
        return self.valid.sum(dim=(1, 2))

    @property
    def correct_count(self) -> torch.Tensor:
        return (self.correct & self.valid).sum(dim=(1, 2))


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
        supervised, 0 elsewhere; not differentiated); rows: `soft_ce_rows` or a compiled copy of it.
    Returns: (loss () fp32, ce (K, B, T) fp32 unweighted, argmax (K, B, T) int64); only loss is differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, p, w, rows):
        K, B, T, H = x.shape
        W = weight.to(x.dtype)
        Vd = W.shape[0]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = x.new_empty(K, B, T, H) if need_x else None
        gw, acc = None, torch.promote_types(x.dtype, torch.float32)  # W's gradient summed in at least fp32
        group = max(1, HEAD_GEMM_ROWS // (B * T))  # steps whose gradient GEMMs run as one
        ce, top = [], []
        for i0 in range(0, K, group):
            n = min(group, K - i0)
            G = x.new_empty(n, B, T, Vd) if need_x or need_w else None  # (n, B, T, Vd)
            for j in range(n):
                i = i0 + j
                ce_i, g_i, top_i = rows(x[i] @ W.T, p[:, 1 + i:1 + i + T], w[i])  # (B, T), (B, T, Vd), (B, T)
                if G is not None:
                    G[j] = g_i
                ce.append(ce_i)
                top.append(top_i)
            if need_x:
                gx[i0:i0 + n] = G @ W  # (n, B, T, H)
            if need_w:
                part = (G.view(-1, Vd).T @ x[i0:i0 + n].reshape(-1, H)).to(acc)  # (Vd, H)
                gw = part if gw is None else gw + part
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
                (gw * grad).to(ctx.weight_dtype) if gw is not None else None, None, None, None)


# FSDP2 finds a forward's output tensors by pytree traversal and hooks its pre-backward work on them,
# including the root's end-of-backward wait for the gradient reduce-scatter. Without this registration it
# cannot see into TTTOutput: on CUDA (asynchronous reduce-scatter) each rank then stepped on its own
# unreduced gradient (grad norm sqrt(2) x the single-GPU one on 2 H200s); synchronous gloo hid it on CPU.
pytree.register_dataclass(TTTOutput)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end to the same length (B, T, ...)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def step_masks(loss_mask: torch.Tensor, steps: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """valid[i, b, t]: step i at index t predicts token t+2+i, which exists, is supervised and, in a packed
    row (documents (B, T)), belongs to t's document. (K, B, T)"""
    masks = []
    for i in range(steps):
        m = shift_left(loss_mask, 2 + i).bool()
        if documents is not None:
            m = m & (shift_left(documents, 2 + i) == documents)
        masks.append(m)
    return torch.stack(masks)


@torch.no_grad()
def target_argmax(last: torch.Tensor, head: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """argmax over the full target vocabulary of last @ head^T, in row chunks. (B, T) int64"""
    flat = last.reshape(-1, last.shape[-1])
    head = head.to(flat.dtype)
    # On CPU, 256-row chunks keep each (256 x V) logits block in cache while max() reads it, so the argmax
    # costs next to nothing on top of the GEMM (SmolLM2 head, 4096 rows, bf16, 2 cores, torch 2.13:
    # GEMM 0.23 s; GEMM + max 0.23 s in 256-row chunks, 0.38 s in 1024-row chunks). max().indices, not
    # argmax(): the same first-maximum index, 2.7x faster over bf16 rows on CPU.
    chunk = chunk or (256 if flat.device.type == "cpu" else 1024)
    out = torch.cat([F.linear(flat[i:i + chunk], head).max(dim=-1).indices for i in range(0, flat.shape[0], chunk)])
    return out.view(last.shape[:-1])


def ttt_forward(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                last: torch.Tensor, target_head: torch.Tensor, steps: int = TTT_STEPS,
                decay: float = TTT_STEP_LOSS_DECAY, denominators: torch.Tensor | None = None,
                t_argmax: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> TTTOutput:
    """Unroll K steps of training-time test and compute the soft cross-entropy loss.

    Args:
        aux: (B, T, 3Ht) aux states; input_ids, loss_mask: (B, T); last: (B, T, Ht) the target's final
            post-norm hidden state; target_head: (V, Ht) the target's lm_head weight.
        denominators: (K,) supervised-position counts over the global batch (for exact DDP / gradient
            accumulation parity); defaults to this batch's counts.
        t_argmax: (B, T) the target's argmax over its full vocabulary, if already known (the store keeps it).
        documents: (B, T) packed rows: the document number of each token within its row (padding is a
            document of its own). Positions restart per document, step-0 attention stays inside it and only
            predictions of tokens of the same document are supervised, so a packed batch has the loss and
            the per-token weights of the same documents unpacked. Inputs that reach across a boundary (the
            token fed at t+1+i, the step-0 key at a document's last index) only reach positions whose
            predictions lie past the document's end, which carry weight 0.
    Returns:
        TTTOutput. Step i at index t is fed token t+1+i and predicts token t+2+i, whose target
        distribution is the target's softmax at t+1+i restricted to the draft vocabulary.
    """
    valid = step_masks(loss_mask, steps, documents)  # (K, B, T)
    cfg = drafter.config
    B, T = input_ids.shape
    H = cfg.hidden_size
    draft_ids = torch.arange(cfg.draft_vocab_size, device=aux.device) + drafter.d2t
    with torch.no_grad():
        # Rows T..T+K-1 are padding, so that step i reads rows [1+i, 1+i+T) as a view; their weight is 0.
        z = F.pad(last, (0, 0, 0, steps)) @ target_head[draft_ids].T.to(last.dtype)  # (B, T+K, Vd)
        p_target = torch.softmax(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)
        del z
        if t_argmax is None:
            t_argmax = target_argmax(last, target_head)  # (B, T)
        in_vocab = F.pad(drafter.t2d[t_argmax], (0, steps))  # (B, T+K): a drafter can only match tokens in its vocabulary
    if denominators is None:
        denominators = valid.sum(dim=(1, 2))
    scales = (torch.tensor([decay ** i for i in range(steps)], dtype=p_target.dtype, device=aux.device)
              / denominators.clamp(min=1))  # (K,): step i's loss weight per supervised row
    if documents is None:
        positions, mask = torch.arange(T, device=aux.device), None  # (T,)
    else:  # (B, T); the mask in the form the step's attention takes on this device
        positions = document_positions(documents)
        mask = document_block_mask(documents) if aux.is_cuda else document_mask(documents)
    attn = drafter.midlayer.self_attn
    w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # ((nh + 2 nkv) hd, 2H)
    # The embedding half of q/k/v at step i is that of step 0 shifted by i tokens: projected once, over the
    # tokens fed at any step (step i at index t is fed token t+1+i; zeros past the end, as shift_left pads).
    ahead = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, steps)], dim=1)  # (B, T-1+K)
    e_qkv = F.linear(drafter.midlayer.input_layernorm(drafter.embed_tokens(ahead)), w_qkv[:, :H])  # (B, T-1+K, .)
    w_h = w_qkv[:, H:]
    h = drafter.fc(aux)  # (B, T, H)
    cache = StepCache()
    xs = []
    for i in range(steps):
        xn, h = drafter.ttt_step(e_qkv[:, i:i + T], h, w_h, positions + i, cache, first=i == 0, mask=mask)
        xs.append(xn)
    # Step i at index t predicts token t+2+i; its target is the target's softmax at t+1+i.
    weight = valid & torch.stack([in_vocab[:, 1 + i:1 + i + T] for i in range(steps)])  # (K, B, T)
    loss, ce, top = DraftHeadLoss.apply(torch.stack(xs), drafter.lm_head.weight, p_target,
                                        weight * scales[:, None, None], drafter.soft_ce_rows)
    t_next = torch.stack([shift_left(t_argmax, 1 + i) for i in range(steps)])  # (K, B, T)
    return TTTOutput(loss=loss, loss_sum=(ce * weight).sum(dim=(1, 2)).detach(),
                     correct=drafter.draft_to_target_ids(top) == t_next, valid=valid)


def compile_for_training(drafter: Eagle3Drafter) -> None:
    """torch.compile the two pieces of the TTT unroll that are elementwise-heavy: the step up to the final
    norm, and the loss's pass over the logits (GPU runs, where it pays back the compile time; a new
    sequence length recompiles once, then runs with dynamic shapes: packed rows (`TrainConfig.pack`) keep
    one shape, so the first step compiles and no later one does)."""
    drafter.ttt_step = torch.compile(drafter.ttt_step)
    drafter.soft_ce_rows = torch.compile(soft_ce_rows)


def simulated_acceptance(correct: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, int]:
    """Mean accepted length (bonus token included) of a k-token chain, greedy, from teacher-forced steps.

    A chain starting at index t accepts steps 0, 1, ... while each is correct and supervised.
    Returns (sum of accepted lengths, number of chains), so results can be summed over batches.
    """
    ok = (correct[:k] & valid[:k]).long()  # (k, B, T)
    run = ok.cumprod(dim=0).sum(dim=0)  # (B, T)
    starts = valid[0]
    return float((run[starts] + 1).sum()), int(starts.sum())
