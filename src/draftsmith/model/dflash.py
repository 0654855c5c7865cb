"""The DFlash drafter (arXiv 2602.06036): a block-diffusion drafter that proposes a whole block in one forward.

Letters: B batch, S sequence (training context), C context length when drafting, A anchors per row,
Bs block size, Q = A * Bs block queries, H drafter hidden (= the target's, whose embedding it reads),
n aux layers, Ht target hidden, V target vocab, nh / nkv heads / KV heads, hd head dim, I MLP width.

    c = hidden_norm(fc(cat(aux_1, ..., aux_n)))    (B, S, H)   context features, one per target position
    x = embed([x_a, MASK, ..., MASK])              (B, Q, H)   one block per anchor a; the target's embedding
    for each layer:
        k_c, v_c = k_norm(k_proj(c)), v_proj(c)    (B, nkv, S, hd)  rope at the context positions; no
                                                                    input_layernorm on c, the same c in every layer
        q, k, v = proj(input_layernorm(x))         (B, nh|nkv, Q, hd)  q_norm / k_norm per head, rope at the
                                                                    block positions a, a+1, ..., a+Bs-1
        x = x + o_proj(attn(q, [k_c; k], [v_c; v]))  a block's queries see the context strictly before its
                                                   anchor (in its document) and their own block, both ways
        x = x + mlp(post_attention_layernorm(x))   SwiGLU
    logits = norm(x) @ lm_head.T                   (B, Q, V)   the target's head

Block position j >= 1 predicts the token AT position a + j (it denoises its mask; no shift): position 0, the
anchor token itself, is context for the block and carries no loss. Attribute names are the checkpoint keys of the
vLLM / z-lab `DFlashDraftModel` layout: `layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`,
`layers.{i}.{input,post_attention}_layernorm`, `layers.{i}.mlp.{gate,up,down}_proj`, `fc`, `hidden_norm`, `norm`.
The target's embedding and head are passed to the forwards, frozen: they are no part of the drafter's weights.

Training (`DFlashDrafter.forward`, SpecForge's objective as in the paper): per row up to `num_anchors` anchors
sampled among supervised positions whose block fits in the row and its document (`sample_anchors`); the label of
block position k is the token at anchor + k, weighted by the loss mask there and exp(-(k-1)/gamma)
(`block_weights`); loss = weighted CE sum / weight sum. Drafting (`DFlashDrafter.propose`) is vLLM's proposer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.model.eagle3 import MLP, RMSNorm, TTTOutput, apply_rope, rope_cos_sin
from draftsmith.model.kernels import DraftHeadLoss, document_positions, flex, hard_ce_rows
from draftsmith.target import TargetSpec

DFLASH_BLOCK_SIZE = 16  # z-lab's published drafters (`-b16`) and the paper's main setting
DFLASH_LAYERS = 5  # z-lab's Qwen3-8B drafter: 5 layers reading 5 target layers
DFLASH_LOSS_GAMMA = 7.0  # the paper's decay for block size 16: position k weighs exp(-(k-1)/gamma)
DFLASH_NUM_ANCHORS = 512  # anchors per row: the order SpecForge's DFlash trainer samples (not re-read here)


@dataclass(frozen=True)
class DFlashConfig:
    """Shapes of a DFlash drafter (a Qwen3 backbone) and what it reads from the target; `from_target` builds it."""

    hidden_size: int
    """H, the target's hidden size: the block is embedded with the target's embedding."""
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """V, the target's vocabulary (its embedding and head)."""
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...]
    """Boundary indices of the target layers fc reads (conventions.py); vLLM's `target_layer_ids` are these - 1."""
    block_size: int
    """Bs: the anchor plus Bs - 1 mask tokens per block; drafting proposes at most Bs - 1 tokens."""
    mask_token_id: int
    """A vocabulary id that never occurs in the data (SmolLM2: `<empty_output>`, 16)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    family: ClassVar[str] = "dflash"

    def __post_init__(self):
        if self.block_size < 2:
            raise DraftsmithError("a DFlash block needs the anchor and at least one mask token",
                                  got=f"block size {self.block_size}", expected="block size >= 2 (default 16)",
                                  fix="pass --block-size 16 (or any size from 2 to 64)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftsmithError("the DFlash mask token is not in the target's vocabulary",
                                  got=f"mask token id {self.mask_token_id}",
                                  expected=f"an id in [0, {self.vocab_size}) that never occurs in the data",
                                  fix="pass --mask-token-id with a special token of the target's tokenizer "
                                      "(SmolLM2: 16, <empty_output>)")
        if not self.aux_layer_ids:
            raise DraftsmithError("a DFlash drafter reads at least one target layer", got="no aux layer ids",
                                  expected="boundary ids such as conventions.default_dflash_aux_ids gives",
                                  fix="pass --aux-ids (online) or capture a store with aux layers")

    @property
    def target_layer_ids(self) -> list[int]:
        """vLLM's and z-lab's 0-based layer-output ids (dflash_config.target_layer_ids)."""
        return [i - 1 for i in self.aux_layer_ids]

    @classmethod
    def from_target(cls, spec: TargetSpec, aux_layer_ids: tuple[int, ...], block_size: int = DFLASH_BLOCK_SIZE,
                    mask_token_id: int = 0, num_layers: int = DFLASH_LAYERS) -> DFlashConfig:
        """A Qwen3-style drafter of the target's hidden size and head layout (MLA targets: head_dim 128 and as
        many KV heads as query heads, as `DrafterConfig.from_target` does)."""
        if spec.is_mla:
            head_dim = 128
            heads = kv_heads = max(1, spec.hidden_size // head_dim)
        else:
            head_dim, heads, kv_heads = spec.head_dim, spec.num_heads, spec.num_kv_heads
        return cls(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_layers=num_layers,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=spec.vocab_size,
                   target_hidden_size=spec.hidden_size, target_num_layers=spec.num_layers,
                   aux_layer_ids=tuple(aux_layer_ids), block_size=block_size, mask_token_id=mask_token_id,
                   rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                   max_position_embeddings=spec.max_position_embeddings)

    def to_dict(self) -> dict:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids), "family": self.family}

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        d = {k: v for k, v in d.items() if k != "family"}
        return cls(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})


# --- the model, in paper order ---------------------------------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention of q (B, nh, Q, hd) over k, v (B, nkv, L, hd) under `mask`: a (B, Q, L) bool (SDPA, any device)
    or a FlexAttention BlockMask (CUDA training). Returns (B, nh, Q, hd)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return flex(q, k, v, mask, scale, lse=False)


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's (from c) followed by the block's own."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)  # per head, over hd
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """(B, L, n hd) -> (B, n, L, hd)"""
        B, L, _ = x.shape
        return x.view(B, L, n, self.hd).transpose(1, 2)

    def context_kv(self, c: torch.Tensor, rope_c: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys and values: c (B, S, H) -> k_c, v_c (B, nkv, S, hd), k_c normed and rotated at the
        context positions (rope_c: cos, sin (B, 1, S, hd)). What vLLM precomputes into its cache once per token."""
        k_c = apply_rope(self.k_norm(self.heads(self.k_proj(c), self.nkv)), *rope_c)  # (B, nkv, S, hd)
        return k_c, self.heads(self.v_proj(c), self.nkv)

    def forward(self, h: torch.Tensor, kv_c: tuple[torch.Tensor, torch.Tensor], rope_q: tuple, mask) -> torch.Tensor:
        """h (B, Q, H) the normed block; kv_c: `context_kv`'s (B, nkv, S, hd) pair; rope_q: cos, sin (B, 1, Q, hd);
        mask: `attend`'s, over the S context keys then the Q block keys. Returns (B, Q, H)."""
        B, Q, _ = h.shape
        k_c, v_c = kv_c
        q = apply_rope(self.q_norm(self.heads(self.q_proj(h), self.nh)), *rope_q)  # (B, nh, Q, hd)
        k_q = apply_rope(self.k_norm(self.heads(self.k_proj(h), self.nkv)), *rope_q)  # (B, nkv, Q, hd)
        k = torch.cat([k_c, k_q.to(k_c.dtype)], dim=2)  # (B, nkv, S+Q, hd)
        v = torch.cat([v_c, self.heads(self.v_proj(h), self.nkv).to(v_c.dtype)], dim=2)
        out = attend(q, k.to(q.dtype), v.to(q.dtype), mask)  # (B, nh, Q, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))  # (B, Q, H)


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer over the block; checkpoint prefix `layers.{i}.`."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_c: tuple[torch.Tensor, torch.Tensor], rope_q: tuple, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x).to(x.dtype), kv_c, rope_q, mask)  # (B, Q, H)
        return x + self.mlp(self.post_attention_layernorm(x).to(x.dtype))


@dataclass(frozen=True)
class Anchors:
    """Sampled block starts: positions (B, A) int64 and valid (B, A) bool (a row with fewer candidates than A
    fills the rest with invalid anchors at 0, which see only their own block and carry no loss)."""

    positions: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class Proposal:
    """A drafted block: tokens (B, k) greedy draft ids and logits (B, k, V) for positions p+1 .. p+k."""

    tokens: torch.Tensor
    logits: torch.Tensor


class DFlashDrafter(nn.Module):
    """The DFlash drafter: `forward` trains on sampled blocks, `propose` drafts one block per row."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.unroll = dflash_unroll  # what `forward` runs; `compile_for_training` swaps in a compiled copy

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, L, hd) for positions (B, L)."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return cos[:, None], sin[:, None]

    def blocks(self, aux: torch.Tensor, ctx_positions: torch.Tensor, block_ids: torch.Tensor,
               block_positions: torch.Tensor, mask, embed: torch.Tensor) -> torch.Tensor:
        """The drafter's layers over blocks of tokens, up to the final norm (both forwards run this).

        Args:
            aux: (B, S, n Ht) the target's aux states at the context positions; ctx_positions: (B, S) their RoPE
                positions; block_ids, block_positions: (B, Q); mask: (B, Q, S+Q) bool or a BlockMask, which keys
                (context, then block) each query sees; embed: (V, H) the target's embedding, frozen.
        Returns:
            norm(x) (B, Q, H) in the residual stream's dtype: the head's input.
        """
        return self.blocks_over(self.context_kv(aux, ctx_positions), block_ids, block_positions, mask, embed)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of context positions: aux (B, S, n Ht) at positions (B, S) -> a list of
        (B, nkv, S, hd) pairs. A decoder computes them once per committed token and caches them."""
        c = self.hidden_norm(self.fc(aux))  # (B, S, H)
        rope_c = self.rope(positions)
        return [layer.self_attn.context_kv(c, rope_c) for layer in self.layers]

    def blocks_over(self, kv_c: list[tuple[torch.Tensor, torch.Tensor]], block_ids: torch.Tensor,
                    block_positions: torch.Tensor, mask, embed: torch.Tensor) -> torch.Tensor:
        """`blocks` from the context's keys and values (`context_kv`, per layer): norm(x) (B, Q, H)."""
        x = F.embedding(block_ids, embed)  # (B, Q, H)
        rope_q = self.rope(block_positions)
        for layer, kv in zip(self.layers, kv_c):
            x = layer(x, kv, rope_q, mask)  # (B, Q, H)
        return self.norm(x).to(x.dtype)

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, embed: torch.Tensor,
                head: torch.Tensor, anchors: Anchors | None = None, gamma: float = DFLASH_LOSS_GAMMA,
                denominator: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                num_anchors: int = DFLASH_NUM_ANCHORS, generator: torch.Generator | None = None,
                head_rows: int | None = None) -> TTTOutput:
        """The training forward: blocks at sampled anchors, their weighted CE. DDP wraps this.

        Args:
            aux: (B, S, n Ht); input_ids, loss_mask: (B, S); embed, head: (V, H) the target's, frozen.
            anchors: the blocks to train (default: `sample_anchors` with num_anchors and generator).
            gamma: position k's weight decays as exp(-(k-1)/gamma).
            denominator: () the weight sum over the global batch (exact DDP / gradient-accumulation parity;
                `block_weights` of every micro-batch's anchors); default this batch's.
            documents: (B, S) packed rows: each token's document number. Positions restart per document and a
                block sees only its own document's context.
            head_rows: the most label rows a micro-batch of the run has (`DraftHeadLoss`'s group_rows).
        Returns:
            TTTOutput, the EAGLE-3 unroll's named result read per block position: loss () the weighted loss;
            loss_sum (P,) unweighted CE summed over supervised labels, P = Bs - 1 positions (k = 1..Bs-1);
            correct, valid (P, B, A): the argmax is the label, the label is supervised. The expected accepted
            length of a greedy block (1 + leading correct positions) is `eagle3.simulated_acceptance(correct,
            valid, P)`, whose chains are then the blocks.
        """
        B, S = input_ids.shape
        if documents is None:
            documents = torch.zeros_like(input_ids)
        if anchors is None:
            anchors = sample_anchors(loss_mask, documents, self.config.block_size, num_anchors, generator)
        mask = block_attention_mask(anchors.positions, documents, self.config.block_size,
                                    flex_mask=aux.is_cuda)
        return self.unroll(self, aux, input_ids, loss_mask, embed, head, anchors, gamma, denominator, documents,
                           mask, head_rows)

    def propose(self, ctx_aux: torch.Tensor, ctx_positions: torch.Tensor, anchor_ids: torch.Tensor,
                anchor_positions: torch.Tensor, k: int, embed: torch.Tensor, head: torch.Tensor,
                ctx_valid: torch.Tensor | None = None) -> Proposal:
        """Draft k tokens per row in one forward, as vLLM's DFlash proposer does.

        Same-position semantics: the target has hidden states for the committed tokens at positions 0..p-1 (the
        context, `ctx_aux`), and the next token x_p (the bonus / last sampled one, `anchor_ids`) has none yet. The
        query block is [x_p, MASK x k] at positions p, p+1, ..., p+k; every query sees the whole context and the
        whole block (non-causal). The output at block position j >= 1 predicts the token AT position p+j (it
        denoises that mask; no shift), so the drafts are positions 1..k and block position 0 gives nothing.

        Args:
            ctx_aux: (B, C, n Ht) the target's aux states at the context positions (all strictly before p);
            ctx_positions: (B, C) their positions; anchor_ids, anchor_positions: (B,) x_p and p;
            k: drafts per row, 1..Bs-1; embed, head: (V, H) the target's;
            ctx_valid: (B, C) bool, which context slots are real (padding of shorter rows: False); default all.
        Returns:
            Proposal(tokens (B, k), logits (B, k, V)).
        """
        cfg = self.config
        if not 1 <= k <= cfg.block_size - 1:
            raise DraftsmithError("a DFlash block drafts at most block size - 1 tokens", got=f"k = {k}",
                                  expected=f"1 <= k <= {cfg.block_size - 1} (block size {cfg.block_size})",
                                  fix=f"draft k <= {cfg.block_size - 1} tokens per block")
        B, C = ctx_aux.shape[:2]
        if ctx_valid is None:
            ctx_valid = torch.ones(B, C, dtype=torch.bool, device=ctx_aux.device)
        return self.propose_over(self.context_kv(ctx_aux, ctx_positions), ctx_valid, anchor_ids, anchor_positions,
                                 k, embed, head)

    def propose_over(self, kv_c: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor,
                     anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, k: int, embed: torch.Tensor,
                     head: torch.Tensor) -> Proposal:
        """`propose` from cached context keys and values (`context_kv`, per layer, over C slots; ctx_valid (B, C))."""
        cfg = self.config
        B, C = ctx_valid.shape
        j = torch.arange(k + 1, device=anchor_ids.device)
        ids = torch.cat([anchor_ids[:, None], anchor_ids.new_full((B, k), cfg.mask_token_id)], dim=1)  # (B, k+1)
        mask = torch.cat([ctx_valid[:, None, :].expand(B, k + 1, C),
                          ctx_valid.new_ones(B, k + 1, k + 1)], dim=-1)  # (B, k+1, C+k+1)
        x = self.blocks_over(kv_c, ids, anchor_positions[:, None] + j, mask, embed)  # (B, k+1, H)
        logits = x[:, 1:] @ head.T.to(x.dtype)  # (B, k, V)
        return Proposal(tokens=logits.argmax(dim=-1), logits=logits)


# --- training: anchors, the block mask, the weighted loss ------------------------------------------------


def sample_anchors(loss_mask: torch.Tensor, documents: torch.Tensor | None, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> Anchors:
    """Up to num_anchors distinct anchors per row, uniformly among supervised positions whose block (anchor ..
    anchor + Bs - 1) fits in the row and in the anchor's document; sorted by position. Tensor ops only: a random
    key per position, -1 where no block may start, and the row's top keys. (B, S) -> Anchors (B, min(A, S))."""
    B, S = loss_mask.shape
    end = torch.arange(S, device=loss_mask.device) + block_size - 1  # (S,) each block's last position
    ok = loss_mask.bool() & (end < S)
    if documents is not None:
        ok &= documents.gather(1, end.clamp(max=S - 1).expand(B, S)) == documents
    keys = torch.rand(B, S, generator=generator, device=loss_mask.device).masked_fill(~ok, -1.0)
    top = keys.topk(min(num_anchors, S), dim=1)
    valid = top.values >= 0
    positions, order = torch.where(valid, top.indices, 0).sort(dim=1)
    return Anchors(positions=positions, valid=valid.gather(1, order))


def block_visibility(anchors: torch.Tensor, documents: torch.Tensor, block_size: int):
    """The mask as a FlexAttention mask_mod (b, h, q, kv) -> bool, on broadcastable index tensors: query q (block
    q // Bs of row b) sees context key kv < S when kv is before its anchor and in the anchor's document, and block
    key kv >= S when that key is in the same block. anchors (B, A), documents (B, S)."""
    S = documents.shape[1]

    def visible(b, h, q, kv):
        anchor = anchors[b, q // block_size]
        in_ctx = kv < S
        ctx = in_ctx & (kv < anchor) & (documents[b, kv.clamp(max=S - 1)] == documents[b, anchor])
        own = ~in_ctx & ((kv - S).clamp(min=0) // block_size == q // block_size)
        return ctx | own

    return visible


def block_attention_mask(anchors: torch.Tensor, documents: torch.Tensor, block_size: int, flex_mask: bool = False):
    """The training attention mask over S context keys then Q = A * Bs block keys: a (B, Q, S+Q) bool (SDPA, the CPU
    path) or, with flex_mask, the same as a FlexAttention BlockMask (CUDA: key blocks no query sees are skipped)."""
    B, A = anchors.shape
    S, Q = documents.shape[1], A * block_size
    visible = block_visibility(anchors, documents, block_size)
    if flex_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(visible, B, None, Q, S + Q, device=documents.device)
    d = documents.device
    return visible(torch.arange(B, device=d)[:, None, None], None, torch.arange(Q, device=d)[None, :, None],
                   torch.arange(S + Q, device=d)[None, None, :])  # (B, Q, S+Q)


def block_weights(anchors: Anchors, loss_mask: torch.Tensor, block_size: int, gamma: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Label weights (B, A, Bs-1) in `dtype`: position k = 1..Bs-1 of a valid anchor's block weighs
    loss_mask[anchor + k] * exp(-(k-1)/gamma); the anchor itself (k = 0) is context, not a label."""
    S = loss_mask.shape[1]
    k = torch.arange(1, block_size, device=loss_mask.device)
    at = (anchors.positions[..., None] + k).clamp(max=S - 1)  # (B, A, Bs-1)
    supervised = loss_mask.gather(1, at.flatten(1)).view(at.shape).bool() & anchors.valid[..., None]
    return supervised * torch.exp(-(k - 1).to(dtype) / gamma)


def dflash_unroll(drafter: DFlashDrafter, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  embed: torch.Tensor, head: torch.Tensor, anchors: Anchors, gamma: float,
                  denominator: torch.Tensor | None, documents: torch.Tensor, mask,
                  head_rows: int | None) -> TTTOutput:
    """`forward`'s work from the anchors and the mask to the loss: what `compile_for_training` compiles."""
    cfg = drafter.config
    Bs = cfg.block_size
    B, S = input_ids.shape
    A = anchors.positions.shape[1]
    ctx_positions = document_positions(documents)  # (B, S), restarting per document
    j = torch.arange(Bs, device=aux.device)
    block_positions = (ctx_positions.gather(1, anchors.positions)[..., None] + j).view(B, A * Bs)  # (B, Q)
    block_ids = input_ids.new_full((B, A, Bs), cfg.mask_token_id)
    block_ids[..., 0] = input_ids.gather(1, anchors.positions)  # [x_a, MASK, ..., MASK]
    x = drafter.blocks(aux, ctx_positions, block_ids.view(B, A * Bs), block_positions, mask, embed)  # (B, Q, H)
    x = x.view(B, A, Bs, -1)[:, :, 1:]  # (B, A, Bs-1, H): positions 1.. predict the token at anchor + k
    at = (anchors.positions[..., None] + j[1:]).clamp(max=S - 1)
    labels = input_ids.gather(1, at.flatten(1))  # (B, A (Bs-1))
    weights = block_weights(anchors, loss_mask, Bs, gamma, torch.promote_types(aux.dtype, torch.float32))  # (B, A, Bs-1)
    if denominator is None:
        denominator = weights.sum()
    rows = x.reshape(1, B, A * (Bs - 1), x.shape[-1])
    # DraftHeadLoss reads step i's targets at rows [1+i, 1+i+T): one step, so the labels shift right by one.
    loss, ce, top = DraftHeadLoss.apply(rows, head, F.pad(labels, (1, 0)), (weights / denominator.clamp(min=1e-6)
                                                                             ).view(1, B, -1), hard_ce_rows, head_rows)
    valid = (weights > 0).permute(2, 0, 1)  # (P, B, A), as TTTOutput lays out its steps
    ce = ce.view(B, A, Bs - 1).permute(2, 0, 1)
    correct = (top.view(B, A, Bs - 1) == labels.view(B, A, Bs - 1)).permute(2, 0, 1)
    return TTTOutput(loss=loss, loss_sum=(ce * valid).sum(dim=(1, 2)).detach(), correct=correct, valid=valid)


def compile_for_training(drafter: DFlashDrafter) -> None:
    """torch.compile the training forward after the anchors and the mask (`dflash_unroll`): the layers, the head
    and its loss as one region."""
    drafter.unroll = torch.compile(dflash_unroll)
