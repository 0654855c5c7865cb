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
the whole softmax (see its docstring).
"""

from __future__ import annotations

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
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, hd) for integer positions (T,), Llama's half-rotation layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, hd)
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
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
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


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                  diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Causal attention over step-0 keys plus, per position, that position's keys of later steps.

    Without a (T x T*K) matrix: for query t the diagonal keys contribute mass sum_j exp(d_tj) and value
    sum_j exp(d_tj) v_jt. Both are folded into one extra key placed before position 0 and visible to
    every query: its score is a_t = logsumexp_j d_tj (carried by an extra query channel against a key
    channel of 1), its value a one-hot channel. One causal SDPA call then normalises over everything;
    the one-hot channel of the output is the diagonal's share p_t, and the diagonal's contribution is
    p_t * softmax_j(d_tj) v_jt. a_t is split into a high and a low part so bf16 inputs keep it exact.

    Args:
        q: (B, nh, T, hd); k0, v0: (B, nkv, T, hd); diag_k, diag_v: lists of (B, nkv, T, hd).
    Returns:
        (B, nh, T, hd).
    """
    B, nh, T, hd = q.shape
    nkv = k0.shape[1]
    groups = nh // nkv
    scale = 1.0 / math.sqrt(hd)
    if not diag_k:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale, enable_gqa=groups > 1)
    # Diagonal scores per KV group, without repeating K/V per query head.
    qg = q.view(B, nkv, groups, T, hd)
    dk = torch.stack(diag_k, dim=-2)  # (B, nkv, T, i, hd)
    dv = torch.stack(diag_v, dim=-2)  # (B, nkv, T, i, hd)
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in at least fp32
    d = torch.einsum("bkgtd,bktjd->bkgtj", qg, dk).to(acc) * scale  # (B, nkv, g, T, i)
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
    out = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, is_causal=True, scale=scale,
                                         enable_gqa=groups > 1)[:, :, 1:]  # (B, nh, T, hd+pad)
    share = out[..., hd:hd + 1]  # (B, nh, T, 1): the diagonal keys' total probability
    diag = torch.einsum("bkgtj,bktjd->bkgtd", torch.softmax(d, -1).to(q.dtype), dv).reshape(B, nh, T, hd)
    return out[..., :hd] + share * diag


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

    def step(self, token_ids: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, cache: StepCache,
             first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One TTT step over the whole sequence.

        Args:
            token_ids: (B, T) tokens fed at this step; h: (B, T, H) hidden state fed at this step.
            positions: (T,) RoPE positions of this step's queries and keys.
            cache: keys/values of steps 0..i-1; `first` marks step 0 (whose keys become the causal keys).
        Returns:
            (logits (B, T, Vd), h_out (B, T, H) pre-norm, fed to the next step).
        """
        x, residual = self.midlayer.attention_input(self.embed_tokens(token_ids), h)  # (B, T, 2H), (B, T, H)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        q, k, v = self.midlayer.self_attn.project(x, cos.to(x.dtype), sin.to(x.dtype))
        if first:
            cache.keys, cache.values = [k], [v]
        else:
            cache.keys.append(k)
            cache.values.append(v)
        attn = ttt_attention(q, cache.keys[0], cache.values[0], cache.keys[1:], cache.values[1:])  # (B, nh, T, hd)
        B, _, T, _ = attn.shape
        attn = self.midlayer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))  # (B, T, H)
        h_out = self.midlayer.finish(attn, residual)
        return self.lm_head(self.norm(h_out)), h_out

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


class SoftCrossEntropy(torch.autograd.Function):
    """Per-row soft cross-entropy -sum_v p_v log softmax(z)_v = s * logsumexp(z) - sum_v p_v z_v, s = sum_v p_v.

    Fused by hand so that no fp32 log-probabilities of shape (B, T, Vd) are kept for the backward
    (7 TTT steps x T x Vd x 4 bytes: 7.3 GB at T = 8192, Vd = 32k): the backward recomputes
    softmax(z) from the saved logits and the row's logsumexp, and its gradient is (s softmax(z) - p) g.

    Args: logits (..., Vd) any float dtype; p (..., Vd) fp32 target probabilities (not differentiated).
    Returns: (...) fp32.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(z, dim=-1)  # (...)
        s = p.sum(-1)
        ctx.save_for_backward(logits, p, lse, s)
        return s * lse - (p * z).sum(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, p, lse, s = ctx.saved_tensors
        g = (torch.exp(logits.to(lse.dtype) - lse[..., None]) * s[..., None] - p) * grad[..., None]
        return g.to(logits.dtype), None


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


def step_masks(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """valid[i, b, t]: step i at index t predicts token t+2+i, which exists and is supervised. (K, B, T)"""
    return torch.stack([shift_left(loss_mask, 2 + i).bool() for i in range(steps)])


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
                t_argmax: torch.Tensor | None = None) -> TTTOutput:
    """Unroll K steps of training-time test and compute the soft cross-entropy loss.

    Args:
        aux: (B, T, 3Ht) aux states; input_ids, loss_mask: (B, T); last: (B, T, Ht) the target's final
            post-norm hidden state; target_head: (V, Ht) the target's lm_head weight.
        denominators: (K,) supervised-position counts over the global batch (for exact DDP / gradient
            accumulation parity); defaults to this batch's counts.
        t_argmax: (B, T) the target's argmax over its full vocabulary, if already known (the store keeps it).
    Returns:
        TTTOutput. Step i at index t is fed token t+1+i and predicts token t+2+i, whose target
        distribution is the target's softmax at t+1+i restricted to the draft vocabulary.
    """
    valid = step_masks(loss_mask, steps)  # (K, B, T)
    draft_ids = torch.arange(drafter.config.draft_vocab_size, device=aux.device) + drafter.d2t
    with torch.no_grad():
        z = last @ target_head[draft_ids].T.to(last.dtype)  # (B, T, Vd)
        p_target = torch.softmax(z.float(), dim=-1)
        if t_argmax is None:
            t_argmax = target_argmax(last, target_head)  # (B, T)
        in_vocab = drafter.t2d[t_argmax]  # (B, T): a drafter can only match tokens in its vocabulary
    if denominators is None:
        denominators = valid.sum(dim=(1, 2))
    T = input_ids.shape[1]
    positions = torch.arange(T, device=aux.device)
    h = drafter.fc(aux)  # (B, T, H)
    cache = StepCache()
    loss = aux.new_zeros((), dtype=torch.float32)
    loss_sums, corrects = [], []
    for i in range(steps):
        logits, h = drafter.step(shift_left(input_ids, 1 + i), h, positions + i, cache, first=i == 0)
        n = T - 1 - i  # indices t whose target (the target's softmax at t+1+i) exists; views, no copies
        ce = SoftCrossEntropy.apply(logits[:, :n], p_target[:, 1 + i:])  # (B, n)
        weight = valid[i, :, :n] & in_vocab[:, 1 + i:]
        step_sum = (ce * weight).sum()
        loss = loss + (decay ** i) * step_sum / denominators[i].clamp(min=1)
        loss_sums.append(step_sum.detach())
        corrects.append(drafter.draft_to_target_ids(logits.argmax(-1)) == shift_left(t_argmax, 1 + i))
    return TTTOutput(loss=loss, loss_sum=torch.stack(loss_sums), correct=torch.stack(corrects), valid=valid)


def simulated_acceptance(correct: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, int]:
    """Mean accepted length (bonus token included) of a k-token chain, greedy, from teacher-forced steps.

    A chain starting at index t accepts steps 0, 1, ... while each is correct and supervised.
    Returns (sum of accepted lengths, number of chains), so results can be summed over batches.
    """
    ok = (correct[:k] & valid[:k]).long()  # (k, B, T)
    run = ok.cumprod(dim=0).sum(dim=0)  # (B, T)
    starts = valid[0]
    return float((run[starts] + 1).sum()), int(starts.sum())
