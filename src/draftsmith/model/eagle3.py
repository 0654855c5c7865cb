"""The EAGLE-3 drafter (Li et al., arXiv 2503.01840), in paper order, with training-time test.

Letters: B batch, T sequence, H drafter hidden, Ht target hidden, V target vocab, Vd draft vocab,
K TTT steps, nh / nkv heads / KV heads, hd head dim, I MLP width.

    a = cat(aux_low, aux_mid, aux_high)        (B, T, 3Ht)   from the target
    a = input_norm(a)                          (B, T, 3Ht)   only with norm_before_fc (speculators' default)
    h = fc(a)                                  (B, T, H)
    e = embed_tokens(next token)               (B, T, H)     frozen copy of the target's
    x = cat(input_layernorm(e), hidden_norm(h))  (B, T, 2H)  embedding first
    h = h + o_proj(attn(q, k, v of x))         residual is the un-normed h
    h = h + mlp(post_attention_layernorm(h))   SwiGLU
    logits = lm_head(norm(h))                  (B, T, Vd)    h (pre-norm) is fed back for the next step
                                                             (norm(h) with norm_output, speculators' default)

Attribute names are the checkpoint keys of the `LlamaForCausalLMEagle3` layout that vLLM
(`llama_eagle3.py`) and SGLang load: `fc`, `midlayer.{hidden_norm, input_layernorm, self_attn.*,
post_attention_layernorm, mlp.*}`, `norm`, `lm_head`, buffers `d2t`, `t2d`, and `input_norm` where
`norm_before_fc` is set. `embed_tokens` is not
exported (engines share the target's).

Training-time test (docs/training.md §4): step 0 starts from fc(aux); step i > 0 is fed the
previous step's pre-norm output and the ground-truth token one further; queries of step i sit at RoPE
position t + i; keys of step 0 are causal over the sequence and keys of steps 1..i are visible only at
the same index t (the diagonal). The kernels live in kernels.py: `ttt_attention` computes exactly that without a (T x T*K) score
matrix: the diagonal keys are folded into one extra "summary" key, so a single causal SDPA call does
the whole softmax (see its docstring); on CUDA `ttt_attention_lse` computes the same by merging the
causal part's log-sum-exp with the diagonal's, which keeps the flash kernel at the plain head dim.
`ttt_forward` also projects the embedding half of q/k/v once per unroll, and `DraftHeadLoss` runs the
head, the loss and the argmax of all steps without keeping any (T x Vd) logits. Packed rows (several
documents per row, `documents`) restart positions per document and keep step-0 attention inside it:
one document at a time on CPU (a dense mask where compiled), a FlexAttention block mask on CUDA (kernels.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from draftsmith.model.kernels import (DraftHeadLoss, document_block_mask, document_mask, document_positions, document_spans,
                                is_block_mask, repeat_kv, soft_ce_rows, SwiGLUDown, ttt_attention, ttt_attention_lse)
from draftsmith.target import TargetSpec, target_argmax


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
    """Boundary indices into the target's `output_hidden_states` (docs/design.md, "Conventions")."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    """False: the residual is the un-normed fc output (EAGLE / SpecForge / SGLang); True: speculators."""
    norm_before_fc: bool = False
    """True: an RMSNorm (`input_norm`, 3Ht wide) over the concatenated aux states before fc (speculators
    0.9.0's default; vLLM's llama_eagle3 reads it from the config or its eagle_config)."""
    norm_output: bool = False
    """True: the state fed back to the next draft step is the final norm's output, not the pre-norm sum
    (speculators 0.9.0's default; vLLM's llama_eagle3 `aux_output`)."""
    family: ClassVar[str] = "eagle3"
    """The drafter family (model/checkpoint.py's FAMILIES); not written: a drafter block without one is EAGLE-3's."""

    @classmethod
    def from_target(cls, spec: TargetSpec, draft_vocab_size: int, aux_layer_ids: tuple[int, int, int]) -> DrafterConfig:
        """A one-layer dense Llama drafter of the target's hidden size.

        GQA targets keep their head layout. MLA targets (DeepSeek-V3, Kimi-K2) get a dense Llama layer
        with head_dim 128 and as many KV heads as query heads (the layout of public Kimi drafters,
        docs/training.md §7.6).
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
        # = down_proj(silu(gate_proj(x)) * up_proj(x)), with the product recomputed in the backward
        return SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


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
    causal_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    """Step 0's keys and values repeated to the query heads, made once per unroll where the kernel needs them."""

    def repeated_causal_kv(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.causal_kv is None:
            self.causal_kv = (repeat_kv(self.keys[0], groups), repeat_kv(self.values[0], groups))
        return self.causal_kv


@dataclass
class DrafterCache:
    """The drafter's single-layer KV cache while decoding (the reference decoder's; `decode_step` appends to it).

    Slot j of every row holds the key and value of one position fed earlier; which slots a query may see is the
    caller's mask, not the order here, so a rejected draft's slots are cropped or masked out, never shifted.
    """

    keys: torch.Tensor | None = None
    """(B, nkv, L, hd) keys of the L cached slots, after RoPE; None before the first step."""
    values: torch.Tensor | None = None
    """(B, nkv, L, hd) values of the same slots."""

    @property
    def length(self) -> int:
        """L, the cached slots per row."""
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add n new slots, k and v (B, nkv, n, hd); return every key and value, (B, nkv, L+n, hd)."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys, self.values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first `length` slots (drop provisional draft entries)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (B',) of the batch (rows that finished leave it)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. Buffers d2t (Vd,) int64 and t2d (V,) bool map draft ids to target ids."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.ttt_unroll = ttt_unroll  # what `ttt_forward` runs; `compile_for_training` swaps in a compiled copy

    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """h = fc(a), through input_norm first where norm_before_fc is set. (B, T, 3Ht) -> (B, T, H)"""
        return self.fc(self.input_norm(aux) if self.config.norm_before_fc else aux)

    def fed_back(self, h_out: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """The state the next draft step is fed: h_out (B, T, H) pre-norm, or norm(h_out) with norm_output
        (`normed`, if the caller has it already)."""
        if not self.config.norm_output:
            return h_out
        return self.norm(h_out).to(h_out.dtype) if normed is None else normed

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, attend) -> torch.Tensor:
        """The decoder layer from the q/k/v projections on: heads and RoPE, `attend`, o_proj, residual and MLP.

        Both forward paths call it: `ttt_step` (training: the TTT unroll's attention over earlier steps) and
        `decode_step` (the reference decoder: a KV cache and a tree mask); they differ in how q/k/v are
        projected and in `attend`, nothing else.

        Args:
            q: (B, T, nh hd), k and v: (B, T, nkv hd) projections of x = cat(input_layernorm(e), hidden_norm(h));
            residual: (B, T, H); cos, sin: RoPE tables broadcastable to (B, nh, T, hd);
            attend: (q (B, nh, T, hd), k, v (B, nkv, T, hd)) -> attention output (B, nh, T, hd).
        Returns:
            h_out (B, T, H), pre-norm.
        """
        attn_mod = self.midlayer.self_attn
        B, T, _ = q.shape
        q, k, v = attn_mod.heads(q, k, v, cos.to(q.dtype), sin.to(q.dtype))
        attn = attn_mod.o_proj(attend(q, k, v).transpose(1, 2).reshape(B, T, -1))  # (B, T, H)
        return self.midlayer.finish(attn, residual)

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
            causal keys); mask: packed rows' step-0 mask (`document_mask`, `document_spans` or
            `document_block_mask`) or None.
        Returns:
            (norm(h_out) (B, T, H) in h's dtype, the head's input; the state fed to the next step: h_out (B, T, H)
            pre-norm, or norm(h_out) with norm_output).
        """
        mid, attn_mod = self.midlayer, self.midlayer.self_attn
        hn = mid.hidden_norm(h)
        residual = hn if mid.norm_before_residual else h
        qkv = e_qkv + F.linear(hn, w_h)  # (B, T, (nh + 2 nkv) hd)
        nq, nk = attn_mod.nh * attn_mod.hd, attn_mod.nkv * attn_mod.hd
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (T, hd) or (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd): per-row positions, broadcast over heads
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if first:
                cache.keys, cache.values, cache.causal_kv = [k], [v], None
            else:
                cache.keys.append(k)
                cache.values.append(v)
            # The same math; each the faster where it runs (flash kernels take half precision only; packed rows on
            # CUDA go through FlexAttention's block mask, any dtype).
            lse = is_block_mask(mask) or (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16))
            extra = {}
            if lse and not first and not is_block_mask(mask):  # the flash kernel reads K/V at the query heads
                extra["causal_kv"] = cache.repeated_causal_kv(attn_mod.nh // attn_mod.nkv)
            attention = ttt_attention_lse if lse else ttt_attention
            return attention(q, cache.keys[0], cache.values[0], cache.keys[1:], cache.values[1:],
                             mask=mask, **extra)  # (B, nh, T, hd)

        h_out = self.step(*qkv.split([nq, nk, nk], dim=-1), residual, cos, sin, attend)
        normed = self.norm(h_out).to(h_out.dtype)
        return normed, self.fed_back(h_out, normed)

    def decode_step(self, ids: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, cache: DrafterCache,
                    allowed: torch.Tensor) -> torch.Tensor:
        """The drafter layer over n new positions per row, appending their keys/values to `cache` (L slots before,
        L+n after).

        Args:
            ids: (B, n) tokens fed; h: (B, n, H) hidden states fed (fc(aux) or the drafter's own output);
            pos: (B, n) positions; allowed: (B, n, L+n) bool, cache slots (old and new) each query sees.
        Returns:
            h_out (B, n, H), pre-norm (`decoder.draft_head` gives the logits).
        """
        B, n = ids.shape
        attn_mod = self.midlayer.self_attn
        x, residual = self.midlayer.attention_input(self.embed_tokens(ids), h)  # (B, n, 2H)
        cos, sin = rope_cos_sin(pos.reshape(-1), self.config.head_dim, self.config.rope_theta)  # (B*n, hd)
        cos, sin = cos.view(B, 1, n, -1), sin.view(B, 1, n, -1)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.append(k, v)  # (B, nkv, L+n, hd)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None],
                                                  enable_gqa=True)  # (B, nh, n, hd)

        return self.step(attn_mod.q_proj(x), attn_mod.k_proj(x), attn_mod.v_proj(x), residual, cos, sin, attend)

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


def ttt_forward(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                last: torch.Tensor, target_head: torch.Tensor, steps: int = TTT_STEPS,
                decay: float = TTT_STEP_LOSS_DECAY, denominators: torch.Tensor | None = None,
                t_argmax: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                head_rows: int | None = None) -> TTTOutput:
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
        head_rows: the most rows (B x T) a micro-batch of the run has (`DraftHeadLoss`'s group_rows): the head's
            grouping of TTT steps then does not change with the batch's shape. The math is the same either way.
    Returns:
        TTTOutput. Step i at index t is fed token t+1+i and predicts token t+2+i, whose target
        distribution is the target's softmax at t+1+i restricted to the draft vocabulary.

    Runs `drafter.ttt_unroll`: `ttt_unroll`, or the compiled copy `compile_for_training` put there.
    """
    return drafter.ttt_unroll(drafter, aux, input_ids, loss_mask, last, target_head, steps, decay, denominators,
                              t_argmax, documents, head_rows)


def ttt_unroll(drafter: Eagle3Drafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               last: torch.Tensor, target_head: torch.Tensor, steps: int, decay: float,
               denominators: torch.Tensor | None, t_argmax: torch.Tensor | None,
               documents: torch.Tensor | None, head_rows: int | None = None) -> TTTOutput:
    """`ttt_forward`'s work, from the batch to the loss: the function `compile_for_training` compiles whole, so
    that nothing of the forward (the target's softmax, the masks, the positions, the head and its loss) runs as
    eager kernels around the compiled region."""
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
    # (K,): step i's loss weight per supervised row. Made on the device: a tensor built from a Python list is a
    # pageable host-to-device copy, which synchronises the stream in the middle of every forward.
    scales = (torch.pow(decay, torch.arange(steps, dtype=p_target.dtype, device=aux.device))
              / denominators.clamp(min=1))
    if documents is None:
        positions, mask = torch.arange(T, device=aux.device), None  # (T,)
    else:  # (B, T); the mask in the form the step's attention takes on this device
        positions = document_positions(documents)
        if aux.is_cuda:
            mask = document_block_mask(documents)  # FlexAttention skips the blocks outside every document
        elif torch.compiler.is_compiling():
            mask = document_mask(documents)  # one graph: no host read of the spans
        else:
            mask = document_spans(documents)  # eager CPU: one document at a time, no T x T mask
    attn = drafter.midlayer.self_attn
    w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # ((nh + 2 nkv) hd, 2H)
    # The embedding half of q/k/v at step i is that of step 0 shifted by i tokens: projected once, over the
    # tokens fed at any step (step i at index t is fed token t+1+i; zeros past the end, as shift_left pads).
    ahead = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, steps)], dim=1)  # (B, T-1+K)
    e_qkv = F.linear(drafter.midlayer.input_layernorm(drafter.embed_tokens(ahead)), w_qkv[:, :H])  # (B, T-1+K, .)
    w_h = w_qkv[:, H:]
    h = drafter.project_aux(aux)  # (B, T, H)
    cache = StepCache()
    xs = []
    for i in range(steps):
        xn, h = drafter.ttt_step(e_qkv[:, i:i + T], h, w_h, positions + i, cache, first=i == 0, mask=mask)
        xs.append(xn)
    # Step i at index t predicts token t+2+i; its target is the target's softmax at t+1+i.
    weight = valid & torch.stack([in_vocab[:, 1 + i:1 + i + T] for i in range(steps)])  # (K, B, T)
    loss, ce, top = DraftHeadLoss.apply(torch.stack(xs), drafter.lm_head.weight, p_target,
                                        weight * scales[:, None, None], soft_ce_rows, head_rows)
    t_next = torch.stack([shift_left(t_argmax, 1 + i) for i in range(steps)])  # (K, B, T)
    return TTTOutput(loss=loss, loss_sum=(ce * weight).sum(dim=(1, 2)).detach(),
                     correct=drafter.draft_to_target_ids(top) == t_next, valid=valid)


def compile_for_training(drafter: Eagle3Drafter, cuda_graphs: bool = False) -> None:
    """torch.compile the drafter's whole training forward, `ttt_unroll`: the target's softmax over the draft
    vocabulary, the step masks, positions and document mask, the K TTT steps and the head's loss (GPU runs, where
    it pays back the compile time). One compiled region with one forward and one backward graph: each eager op
    around a compiled region costs a kernel launch and each region a guard check, a launch and copies of its
    inputs, the host time that bounded the small drafter's step (docs/gpu.md, "CUDA graphs over the compiled
    step"). Packed rows (`TrainConfig.pack`) keep one shape, so the first step compiles and no later one does;
    unpacked micro-batches recompile once for dynamic shapes (and for a micro-batch of one row, which dynamo
    specialises), not per grouping of the loss's TTT steps when the caller passes `head_rows` (the Trainer does).

    cuda_graphs: the forward and backward graphs replay as CUDA graphs (torch.compile's `reduce-overhead` mode,
    CUDA graph trees): one launch each instead of one per kernel. The caller marks each forward's start
    (`torch.compiler.cudagraph_mark_step_begin`) and keeps the inputs that do not change between steps (the
    target's head) at a static address (`torch._dynamo.mark_static_address`), so a replay copies only the batch;
    on CPU the mode compiles as the default one."""
    import torch._dynamo.config as dynamo_config

    # One graph per shape and grad mode (training, evaluation), and per grouping of the loss's TTT steps: torch's
    # default limit (8) would send later shapes of unpacked runs back to eager without a word.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * TTT_STEPS)
    # torch 2.11's coalescing analysis (it only chooses tile shapes) asserts on the unpacked step's dynamic-shape
    # reductions (InductorError in tiling_utils.get_pw_red_splits, one H200, 2026-12-05): off, where it exists
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        inductor_config.triton.coalesce_tiling_analysis = False
    # triton.cudagraphs is what mode="reduce-overhead" sets (torch.compile takes a mode or options, not both).
    # CUDA graphs replay one recorded shape each (packing gives one): static shapes, so that a second shape is
    # compiled as its own static graph rather than dynamic in the row length (inductor cannot split the block
    # mask's 128-token blocks of a symbolic length).
    options = {"triton.cudagraphs": True} if cuda_graphs else {}
    drafter.ttt_unroll = torch.compile(ttt_unroll, options=options, dynamic=False if cuda_graphs else None)


def simulated_acceptance(correct: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, int]:
    """Mean accepted length (bonus token included) of a k-token chain, greedy, from teacher-forced steps.

    A chain starting at index t accepts steps 0, 1, ... while each is correct and supervised.
    Returns (sum of accepted lengths, number of chains), so results can be summed over batches.
    """
    ok = (correct[:k] & valid[:k]).long()  # (k, B, T)
    run = ok.cumprod(dim=0).sum(dim=0)  # (B, T)
    starts = valid[0]
    return float((run[starts] + 1).sum()), int(starts.sum())


def engine_walk_acceptance(correct: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, int]:
    """Mean accepted length (bonus token included) of k-token greedy chains placed the way an engine places them.

    `simulated_acceptance` starts a chain at every supervised index; an engine starts one only where the last
    verification ended: right after a rejection, where the text is harder than average, so the all-starts figure
    over-states decoded tau at k > 1 (the shipped SmolLM2 drafter on 40 chat-eval answers, CPU, fp32: all starts
    2.80 at k=4, this walk 2.54, decoded by `draftsmith eval` 2.56; docs/eval.md). Each row is walked from its
    first chain: a chain at index t accepts a steps (its leading correct ones, at most k) and the next chain
    starts at t + a + 1. A chain starts only where its root (the token fed at step 0) is itself an answer token,
    as in decoding, where the first token of a turn comes from the target's prefill; indices that cannot start
    a chain (prompts, user turns) are stepped over.
    Returns (sum of accepted lengths, number of chains), like `simulated_acceptance`.
    """
    ok = (correct[:k] & valid[:k]).long().cumprod(dim=0).sum(dim=0)  # (B, T) leading correct steps
    v0 = valid[0]
    can_start = v0 & F.pad(v0, (1, 0))[:, :-1]  # (B, T) supervised, and so is the root token t + 1
    B, T = can_start.shape
    end = torch.full((B, 1), T, device=ok.device)
    # next_start[b, t]: the first index >= t that can start a chain; T (a sentinel slot) where none is left
    idx = torch.where(can_start, torch.arange(T, device=ok.device).expand(B, T), end)
    next_start = torch.cat([idx.flip(-1).cummin(dim=-1).values.flip(-1), end], dim=1)  # (B, T+1)
    # Every start index links to the start after its chain; the walk from a row's first start is that linked
    # list. Its sums come from pointer doubling (log2 T gathers, no loop over chains: packed rows hold 32k
    # tokens): after j rounds, ptr skips 2^j chains and acc/chains sum what they skipped.
    # (pointers of indices that cannot start a chain are never followed: every pointer lands on a start or on T)
    ptr = torch.cat([next_start.gather(1, (torch.arange(T, device=ok.device) + ok + 1).clamp(max=T)), end], dim=1)
    acc = F.pad(torch.where(can_start, ok + 1, 0), (0, 1))  # (B, T+1)
    chains = F.pad(can_start.long(), (0, 1))
    for _ in range(max(1, T.bit_length())):
        acc = acc + acc.gather(1, ptr)
        chains = chains + chains.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    first = next_start[:, :1]  # (B, 1)
    return float(acc.gather(1, first).sum()), int(chains.gather(1, first).sum())


def with_draft_vocab(drafter: Eagle3Drafter, d2t: torch.Tensor, t2d: torch.Tensor,
                     target_head: torch.Tensor) -> Eagle3Drafter:
    """A copy of `drafter` with a larger draft vocabulary (`vocab.grow_draft_vocab`'s maps d2t (V_d',), t2d (V,)).

    Every weight is kept; the head's row of a token the drafter had moves to that token's new draft id, and a new
    token's row starts as the target's lm_head row (target_head (V, H)), scaled by the ratio of the mean row norms
    of the drafter's head and the target's over the tokens they share: 1 for a head started from the target's rows
    and frozen (the normed recipe's), so there the grown head is the target's head restricted to more tokens.
    """
    old_ids = torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device) + drafter.d2t
    new_ids = torch.arange(len(d2t)) + d2t
    old_rows = drafter.lm_head.weight.detach().float().cpu()  # (V_d, H)
    head = target_head.float().cpu()  # (V, H)
    scale = old_rows.norm(dim=1).mean() / head[old_ids.cpu()].norm(dim=1).mean()
    rows = head[new_ids] * scale  # (V_d', H)
    where = torch.full((head.shape[0],), -1, dtype=torch.int64)
    where[old_ids.cpu()] = torch.arange(len(old_ids))
    kept = where[new_ids]  # (V_d',) the old draft id of each new one, -1 for a new token
    rows[kept >= 0] = old_rows[kept[kept >= 0]]
    grown = Eagle3Drafter(replace(drafter.config, draft_vocab_size=len(d2t)))
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    grown.load_state_dict({**state, "lm_head.weight": rows.to(drafter.lm_head.weight.dtype),
                           "d2t": d2t.to(torch.int64), "t2d": t2d}, strict=True)
    return grown.to(drafter.d2t.device)
