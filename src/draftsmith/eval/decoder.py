"""Reference speculative decoder: a Hugging Face target plus a draftsmith drafter (EAGLE-3 or DFlash), batched.

Small functions per phase, in the order one iteration runs them (gpt-fast style):

    prefill   target over the (left-padded) prompts -> first token and the aux features of every prompt position
    draft     drafter: catch up on newly committed positions (true target features), then draft a tree
              (a chain when topk = 1: vLLM's EAGLE-3 default; topk > 1: EAGLE-2 dynamic tree, as SGLang);
              DFlash (`draft_block`): cache the new positions' context keys and values, then one forward over
              [root, MASK x k] drafts a chain of k tokens
    verify    target over the tree's N nodes with its KV cache and a tree attention mask -> logits, aux
    accept    the deepest node whose path matches the target's choices (`tree.accept_path`)
    commit    keep the accepted path in both KV caches, queue its features for the drafter, emit tokens

Batching. Every row of a batch shares one physical KV layout; `DecodeState.target_valid` (B, S) marks
which cache slots a row may attend to (padding and draft nodes a row rejected are holes, masked out).
Positions are explicit per row, so a slot's place in the cache never matters, only its mask bit.
After each verification the accepted nodes of a row are moved to the front of the verified block and
the block is cut to the longest accepted path in the batch: at batch 1 the caches hold exactly the
committed tokens. Finished rows leave the batch. One host sync per iteration (the accepted counts and
emitted tokens); drafting and acceptance stay on the device.

Invariant between iterations: the target has processed every committed token but each row's last
(`root`, at position `root_pos`); the drafter's cache holds entries made from true target features;
`pending` holds the target features of the positions the drafter has not seen yet.

Greedy output is token-identical to the target's greedy decoding. Sampling (temperature > 0) uses
deterministic drafts (the drafter's argmax / top-k) and samples the target at every node: this is
rejection sampling with q = onehot(draft), the rule of vLLM v1's rejection sampler without draft probs
(`sample/rejection_sampler.py`, NO_DRAFT_PROBS: draft_prob = 1, recovery from p with the draft zeroed)
and SGLang's `tree_speculative_sampling_target_only`; the emitted tokens follow the target's
distribution exactly (`tree.accept_path`).

The caller picks the aux ids (`draftsmith eval` reads them the way a chosen engine does, through
`conventions.engine_aux_ids`), so a drafter whose ids the engine misreads shows the collapsed acceptance
it will have in production.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from draftsmith.model.dflash import DFlashDrafter
from draftsmith.model.eagle3 import DrafterCache, Eagle3Drafter
from draftsmith.errors import DraftsmithError
from draftsmith.eval.tree import AcceptedPath, Candidates, DraftTree, accept_path, chain_tree, select_tree


@dataclass(frozen=True)
class DecodeSettings:
    k: int = 4
    """Draft depth: the chain length, or the tree depth (SGLang --speculative-num-steps). 0 = no drafting."""
    temperature: float = 0.0
    max_new_tokens: int = 128
    eos_token_id: int | None = None
    topk: int = 1
    """Children per expanded node (SGLang --speculative-eagle-topk). 1 = chain."""
    draft_tokens: int | None = None
    """Tree nodes per verification, the root included (SGLang --speculative-num-draft-tokens). None = k + 1."""

    def __post_init__(self):
        if self.k < 0 or self.topk < 1:
            raise DraftsmithError("bad draft settings", got=f"k={self.k}, topk={self.topk}",
                                  expected="k >= 0, topk >= 1", fix="--k 4 --topk 1")
        most = 1 + sum(self.topk ** min(d, 2) for d in range(1, self.k + 1))  # topk at depth 1, topk^2 after
        if self.topk == 1 and self.nodes != self.k + 1:
            raise DraftsmithError("a chain (topk 1) verifies k + 1 tokens", got=f"draft_tokens={self.draft_tokens}",
                                  expected=f"{self.k + 1} (as SGLang forces)", fix="drop --draft-tokens or raise --topk")
        if not 1 + min(self.k, 1) <= self.nodes <= most:
            raise DraftsmithError("draft_tokens outside what the tree can hold", got=str(self.nodes),
                                  expected=f"2..{most} for depth {self.k}, topk {self.topk}",
                                  fix="--draft-tokens between depth + 1 and 1 + topk + (depth-1)*topk^2")

    @property
    def nodes(self) -> int:
        return self.draft_tokens or self.k + 1


# --- state ----------------------------------------------------------------------------------------------

@dataclass
class BlockContext:
    """A DFlash drafter's context while decoding: per layer, the keys and values of every committed position the
    target has seen (`DFlashDrafter.context_kv`, made once per position, as vLLM's precompute); which slots a row
    sees is `DecodeState.drafter_valid`. Nothing provisional is ever cached: a block's own keys are not kept."""

    layers: list[DrafterCache]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Add each layer's new slots (B, nkv, n, hd); return every layer's keys and values."""
        return [cache.append(k, v) for cache, (k, v) in zip(self.layers, kv)]

    def select(self, rows: torch.Tensor) -> None:
        for cache in self.layers:
            cache.select(rows)


@dataclass
class ForwardTimes:
    """Seconds inside target and drafter forwards (synchronised on accelerators), for the overhead share."""

    target: float = 0.0
    drafter: float = 0.0


@dataclass
class Pending:
    """Target features the drafter has not consumed yet, one block per row (holes where valid is False)."""

    aux: torch.Tensor
    """(B, n, 3Ht) target features of positions `pos`."""
    ids: torch.Tensor
    """(B, n) the token after each of those positions (what the drafter is fed with the feature)."""
    pos: torch.Tensor
    """(B, n) positions."""
    valid: torch.Tensor
    """(B, n) bool."""

    def select(self, rows: torch.Tensor) -> Pending:
        return Pending(self.aux[rows], self.ids[rows], self.pos[rows], self.valid[rows])


@dataclass
class DecodeState:
    """Everything a batch carries between iterations. Row r of every tensor is sequence `rows[r]`."""

    rows: list[int]
    tokens: list[list[int]]
    """Per sequence (all of them, finished too): committed tokens, prompt included."""
    prompt_lens: list[int]
    target_cache: object
    target_valid: torch.Tensor
    """(B, S) bool: cache slots each row attends to."""
    root: torch.Tensor
    """(B,) each row's last committed token, not yet seen by the target."""
    root_pos: torch.Tensor
    """(B,) its position."""
    drafter_cache: DrafterCache
    drafter_valid: torch.Tensor
    """(B, L) bool."""
    pending: Pending
    accepted: list[list[int]]
    """Per sequence: accepted draft tokens per verification step."""
    timings: ForwardTimes = field(default_factory=ForwardTimes)

    def select(self, keep: list[int]) -> None:
        """Keep only these rows (positions into `rows`)."""
        self.rows = [self.rows[r] for r in keep]
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.root.device)
        self.target_cache.batch_select_indices(idx)
        self.drafter_cache.select(idx)
        self.target_valid, self.drafter_valid = self.target_valid[idx], self.drafter_valid[idx]
        self.root, self.root_pos, self.pending = self.root[idx], self.root_pos[idx], self.pending.select(idx)


@contextmanager
def timed(timings: ForwardTimes, name: str, device: torch.device):
    """Adds the wall time of a block to a ForwardTimes field, synchronising an accelerator first and last."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()  # CPU-GPU sync point: timing only
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()  # CPU-GPU sync point: timing only
    setattr(timings, name, getattr(timings, name) + time.perf_counter() - t0)


# --- forwards -------------------------------------------------------------------------------------------

def target_forward(target, ids: torch.Tensor, pos: torch.Tensor, cache, allowed: torch.Tensor,
                   aux_ids: tuple[int, ...], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Target over new tokens with its cache and an explicit mask.

    Args:
        ids, pos: (B, n) tokens and their positions; allowed: (B, n, S+n) bool, key slots each query sees.
    Returns:
        logits (B, n, V) (or (B, 1, V) with last_only), aux (B, n, 3Ht) ((B, n, 0) without aux_ids).
    """
    if target.config._attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(allowed.shape, dtype=target.dtype, device=ids.device)
        mask = mask.masked_fill(~allowed, torch.finfo(target.dtype).min)[:, None]
    else:
        # (B, 1, n, S+n): a 4D mask reaches attention as is (transformers 5.24 masking_utils.py
        # `_preprocess_mask_arguments`: "If the mask is already 4D, simply return as-is"); SDPA reads True = attend
        mask = allowed[:, None]
    out = target(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                 output_hidden_states=bool(aux_ids), logits_to_keep=1 if last_only else 0)
    aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1) if aux_ids else ids.new_zeros(*ids.shape, 0)
    return out.logits, aux


MASKED_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
"""transformers' switch (read on every SDPA call, `integrations/sdpa_attention.py` `use_gqa_in_sdpa`): with it, a call
that has a mask passes `enable_gqa` to torch's SDPA instead of repeating the KV heads per query group."""


def masked_gqa(device) -> bool:
    """Let the decoder's masked target forwards share KV heads across query groups on a CPU; returns whether on.

    transformers passes `enable_gqa` to SDPA only when no mask is given (CUDA's flash kernel falls back to the math
    kernel otherwise), so every masked call copies K and V once per query group. Plain decoding passes no mask;
    the decoder always passes one (prefill, verification), and torch's CPU SDPA takes a mask with `enable_gqa`.
    Setting the switch on a CPU drops that copy from the speculative side only: the same logits (max |diff| 0 on
    SmolLM2 fp32). It is process-wide; a value already set (e.g. 0) is kept. CUDA: left alone."""
    if torch.device(device).type != "cpu":
        return False
    return os.environ.setdefault(MASKED_GQA, "1") == "1"


def draft_head(drafter: Eagle3Drafter, h: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary log-probabilities (.., Vd) of pre-norm hidden states (.., H)."""
    return torch.log_softmax(drafter.lm_head(drafter.norm(h)).float(), dim=-1)


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token per position (.., V) -> (..): argmax, or one sample at `temperature`."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.view(probs.shape[:-1])


def block_mask(valid_old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(B, n, S+n): every query sees the valid old slots, plus the new slots `new` (B, n, n) allows."""
    B, n, _ = new.shape
    return torch.cat([valid_old[:, None, :].expand(B, n, valid_old.shape[1]), new], dim=-1)


# --- phases ---------------------------------------------------------------------------------------------

@torch.inference_mode()
def prefill(target, prompts: list[list[int]], aux_ids: tuple[int, ...], settings: DecodeSettings,
            generator: torch.Generator | None = None) -> DecodeState:
    """Run the target over the left-padded prompts and choose each row's first new token."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        valid[b, P - len(p):] = True
    ids, valid = ids.to(device), valid.to(device)
    pos = (valid.cumsum(-1) - 1).clamp(min=0)
    eye = torch.eye(P, dtype=torch.bool, device=device)
    allowed = torch.ones_like(eye).tril() & valid[:, None, :] | eye  # causal over real tokens; pads see themselves
    timings, cache = ForwardTimes(), DynamicCache()
    with timed(timings, "target", device):
        logits, aux = target_forward(target, ids, pos, cache, allowed, aux_ids, last_only=True)
    first = choose(logits[:, -1], settings.temperature, generator)  # (B,)
    pending = Pending(aux=aux, ids=torch.cat([ids[:, 1:], first[:, None]], dim=1), pos=pos, valid=valid)
    firsts = first.tolist()  # CPU-GPU sync point: once per prefill
    return DecodeState(rows=list(range(B)), tokens=[list(p) + [t] for p, t in zip(prompts, firsts)],
                       prompt_lens=[len(p) for p in prompts], target_cache=cache, target_valid=valid, root=first,
                       root_pos=valid.sum(-1), drafter_cache=DrafterCache(),
                       drafter_valid=torch.zeros(B, 0, dtype=torch.bool, device=device), pending=pending,
                       accepted=[[] for _ in prompts], timings=timings)


def catch_up(drafter: Eagle3Drafter, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the pending target features to the drafter; returns each row's last (log-probs (B, Vd), h (B, H)),
    h being the state the next draft step is fed (`Eagle3Drafter.fed_back`)."""
    p = state.pending
    B, n = p.ids.shape
    causal = torch.ones(n, n, dtype=torch.bool, device=p.ids.device).tril()
    allowed = block_mask(state.drafter_valid, causal & p.valid[:, None, :] | torch.eye(n, dtype=torch.bool,
                                                                                           device=p.ids.device))
    with timed(state.timings, "drafter", p.ids.device):
        h = drafter.decode_step(p.ids, drafter.project_aux(p.aux), p.pos, state.drafter_cache, allowed)  # (B, n, H)
    state.drafter_valid = torch.cat([state.drafter_valid, p.valid], dim=1)
    last = n - 1 - p.valid.flip(-1).int().argmax(-1)  # (B,) index of each row's last valid entry
    h_last = h[torch.arange(B, device=h.device), last]  # (B, H)
    with timed(state.timings, "drafter", p.ids.device):
        logp = draft_head(drafter, h_last)
    return logp, drafter.fed_back(h_last)


@torch.inference_mode()
def draft(drafter: Eagle3Drafter | None, state: DecodeState, settings: DecodeSettings) -> DraftTree:
    """Catch the drafter up on committed positions, then draft a tree of `settings.nodes` nodes.

    Drafts are the drafter's top-k tokens (argmax for a chain) at every temperature (see the module docstring).
    """
    if settings.k == 0:
        return chain_tree(state.root, state.root.new_zeros(len(state.rows), 0))
    logp, h = catch_up(drafter, state)  # (B, Vd), (B, H)
    B, topk, device = logp.shape[0], settings.topk, logp.device
    committed = state.drafter_cache.length
    score, top = logp.topk(topk, dim=-1)  # (B, topk) depth-1 candidates
    tok = top + drafter.d2t[top]  # draft ids -> target ids
    cands = [(tok, torch.full_like(top, -1), score, 1)]
    frontier = torch.arange(topk, device=device).expand(B, topk)  # candidate ids of the frontier nodes
    h = h[:, None].expand(B, topk, h.shape[-1])
    seen = torch.eye(topk, dtype=torch.bool, device=device).expand(B, topk, topk)  # (B, topk, fed so far)
    offset = topk
    for depth in range(1, settings.k):
        pos = (state.root_pos + depth - 1)[:, None].expand(B, topk)
        with timed(state.timings, "drafter", device):
            h_out = drafter.decode_step(tok, h, pos, state.drafter_cache, block_mask(state.drafter_valid, seen))
            logp = draft_head(drafter, h_out)  # (B, topk, Vd)
        child_score, child = logp.topk(topk, dim=-1)  # (B, topk, topk)
        child_score = (score[:, :, None] + child_score).flatten(1)  # cumulative path log-prob, (B, topk^2)
        child_tok = (child + drafter.d2t[child]).flatten(1)
        cands.append((child_tok, frontier.repeat_interleave(topk, dim=1), child_score, depth + 1))
        score, sel = child_score.topk(topk, dim=-1)  # EAGLE-2: expand only the best topk next
        slot = sel // topk  # which frontier node each new frontier node descends from
        h_out = drafter.fed_back(h_out)
        tok, h = child_tok.gather(1, sel), h_out.gather(1, slot[:, :, None].expand(B, topk, h_out.shape[-1]))
        frontier = offset + sel
        offset += topk * topk
        seen = torch.cat([seen.gather(1, slot[:, :, None].expand(B, topk, seen.shape[2])),
                          torch.eye(topk, dtype=torch.bool, device=device).expand(B, topk, topk)], dim=-1)
    state.drafter_cache.crop(committed)  # draft entries are provisional; accepted ones return as pending
    if topk == 1:
        return chain_tree(state.root, torch.cat([c[0] for c in cands], dim=1))
    cand = Candidates(tokens=torch.cat([c[0] for c in cands], 1), parent=torch.cat([c[1] for c in cands], 1),
                      score=torch.cat([c[2] for c in cands], 1),
                      depth=torch.cat([torch.full((c[0].shape[1],), c[3], device=device) for c in cands]))
    return select_tree(state.root, cand, settings.nodes, settings.k)


@torch.inference_mode()
def draft_block(drafter: DFlashDrafter, state: DecodeState, settings: DecodeSettings, embed: torch.Tensor,
                head: torch.Tensor) -> DraftTree:
    """DFlash: cache the pending positions' context keys and values, then draft the block [root, MASK x k] at
    positions root_pos .. root_pos + k in one drafter forward; its positions 1..k are the chain to verify (vLLM's
    DFlash proposer: K mask queries plus the bonus token's; llama.cpp clamps K to block size - 1)."""
    p = state.pending
    if not isinstance(state.drafter_cache, BlockContext):
        state.drafter_cache = BlockContext([DrafterCache() for _ in drafter.layers])
    with timed(state.timings, "drafter", p.ids.device):
        kv = state.drafter_cache.append(drafter.context_kv(p.aux, p.pos))
        state.drafter_valid = torch.cat([state.drafter_valid, p.valid], dim=1)
        block = drafter.propose_over(kv, state.drafter_valid, state.root, state.root_pos, settings.k, embed, head)
    return chain_tree(state.root, block.tokens)


def check_block_settings(drafter: DFlashDrafter, settings: DecodeSettings) -> None:
    """A DFlash block is a chain of at most block size - 1 drafts."""
    most = drafter.config.block_size - 1
    if settings.topk != 1 or not 0 <= settings.k <= most:
        raise DraftsmithError("a DFlash drafter drafts one chain of at most block size - 1 tokens per block",
                              got=f"k={settings.k}, topk={settings.topk}",
                              expected=f"k in 1..{most} (block size {drafter.config.block_size}), topk 1",
                              fix=f"--k between 1 and {most}, without --topk / --draft-tokens")


def target_embed_head(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head weights (V, H), which a DFlash drafter shares, frozen."""
    return target.get_input_embeddings().weight, target.get_output_embeddings().weight


@torch.inference_mode()
def verify(target, state: DecodeState, tree: DraftTree, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target over the tree's nodes, each seeing the context and its own root path: logits (B, N, V), aux (B, N, 3Ht)."""
    pos = state.root_pos[:, None] + tree.depth
    allowed = block_mask(state.target_valid, tree.ancestry)
    with timed(state.timings, "target", pos.device):
        return target_forward(target, tree.tokens, pos, state.target_cache, allowed, aux_ids)


@torch.inference_mode()
def commit(state: DecodeState, tree: DraftTree, aux: torch.Tensor, settings: DecodeSettings,
           path: AcceptedPath) -> list[list[int]]:
    """Keep each row's accepted path in both caches, queue its features, return the tokens each row emits.

    Accepted nodes move to the front of the verified block (stable: root path order); the block is cut to
    the longest path in the batch; shorter rows keep masked holes.
    """
    B, N = tree.tokens.shape
    count = path.accepted + 1  # (B,) committed tokens per row this step: accepted drafts + bonus
    order = torch.sort((~path.on_path).int(), dim=1, stable=True).indices  # (B, N) accepted nodes first
    path_tok = tree.tokens.gather(1, order)  # root, d_1 .. d_a, then rejected
    nxt = torch.cat([path_tok[:, 1:], path_tok[:, :1]], dim=1)
    nxt.scatter_(1, (count - 1)[:, None], path.bonus[:, None])  # (B, N): the emitted tokens first
    host = torch.cat([count[:, None], nxt], dim=1).tolist()  # CPU-GPU sync point: once per iteration
    keep = max(row[0] for row in host)
    cache = state.target_cache
    if settings.topk > 1:  # a chain's accepted nodes are already a prefix of the block
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)  # (B, nkv, S+N, hd)
                idx = order[:, None, :, None].expand(B, t.shape[1], N, t.shape[3])
                t[:, :, -N:] = t[:, :, -N:].gather(2, idx)
    cache.crop(-(N - keep))
    valid = path.on_path.gather(1, order)[:, :keep]  # (B, keep)
    state.target_valid = torch.cat([state.target_valid, valid], dim=1)
    state.pending = Pending(aux=aux.gather(1, order[:, :keep, None].expand(B, keep, aux.shape[-1])),
                            ids=nxt[:, :keep], pos=state.root_pos[:, None] + torch.arange(keep, device=nxt.device),
                            valid=valid)
    state.root, state.root_pos = path.bonus, state.root_pos + count
    return [row[1:1 + row[0]] for row in host]


def record(state: DecodeState, emitted: list[list[int]], settings: DecodeSettings) -> None:
    """Append each row's emitted tokens (accepted drafts + bonus), then drop finished rows."""
    for seq, new in zip(state.rows, emitted):
        state.tokens[seq] += new
        state.accepted[seq].append(len(new) - 1)
    drop_finished(state, settings)


def drop_finished(state: DecodeState, settings: DecodeSettings) -> None:
    """Rows that reached max_new_tokens or EOS leave the batch."""
    keep = [r for r, seq in enumerate(state.rows)
            if not finished(state.tokens[seq][state.prompt_lens[seq]:], settings)]
    if len(keep) < len(state.rows):
        state.select(keep)


def finished(new: list[int], settings: DecodeSettings) -> bool:
    return len(new) >= settings.max_new_tokens or (settings.eos_token_id is not None and settings.eos_token_id in new)


def trim(new: list[int], settings: DecodeSettings) -> list[int]:
    """The generated tokens, cut at max_new_tokens and after the first EOS."""
    new = new[:settings.max_new_tokens]
    if settings.eos_token_id is not None and settings.eos_token_id in new:
        new = new[:new.index(settings.eos_token_id) + 1]
    return new


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]
    accepted: list[int]
    """Accepted draft tokens per verification step (tau = mean + 1)."""
    seconds: float
    target_seconds: float
    drafter_seconds: float
    top2: list[tuple[float, float]] = field(default_factory=list)
    """Greedy plain decoding only: the target's two highest logits at each generated token."""


@dataclass(frozen=True)
class BatchDecodeResult:
    tokens: list[list[int]]
    """Per prompt, the generated tokens."""
    accepted: list[list[int]]
    """Per prompt, accepted draft tokens per verification step."""
    seconds: float
    target_seconds: float
    drafter_seconds: float


def decode_batch(target, drafter: Eagle3Drafter | DFlashDrafter | None, prompts: list[list[int]], aux_ids: tuple[int, ...],
                 settings: DecodeSettings, seed: int = 0) -> BatchDecodeResult:
    """Decode prompts together with speculation (or plain, with settings.k = 0 and no drafter)."""
    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if settings.temperature > 0 else None
    t0 = time.perf_counter()
    blocks = isinstance(drafter, DFlashDrafter) and settings.k > 0
    if blocks:
        check_block_settings(drafter, settings)
        shared = target_embed_head(target)
    state = prefill(target, prompts, aux_ids, settings, generator)
    drop_finished(state, settings)  # the first token may already finish a row
    while state.rows:
        tree = draft_block(drafter, state, settings, *shared) if blocks else draft(drafter, state, settings)
        logits, aux = verify(target, state, tree, aux_ids)
        path = accept_path(tree, choose(logits, settings.temperature, generator))
        record(state, commit(state, tree, aux, settings, path), settings)
    seconds = time.perf_counter() - t0
    return BatchDecodeResult(tokens=[trim(t[n:], settings) for t, n in zip(state.tokens, state.prompt_lens)],
                             accepted=state.accepted, seconds=seconds, target_seconds=state.timings.target,
                             drafter_seconds=state.timings.drafter)


def speculative_decode(target, drafter: Eagle3Drafter | DFlashDrafter, prompt: list[int], aux_ids: tuple[int, ...],
                       settings: DecodeSettings, seed: int = 0) -> DecodeResult:
    """Decode one prompt with EAGLE-3 drafting (chain or tree) or DFlash blocks; returns the tokens and per-step
    acceptance."""
    res = decode_batch(target, drafter, [prompt], aux_ids, settings, seed)
    return DecodeResult(res.tokens[0], res.accepted[0], res.seconds, res.target_seconds, res.drafter_seconds)


@torch.inference_mode()
def target_decode(target, prompt: list[int], settings: DecodeSettings, seed: int = 0) -> DecodeResult:
    """Plain autoregressive decoding through transformers' own masks: the identity reference and batch-1 baseline."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if settings.temperature > 0 else None
    t0 = time.perf_counter()
    cache = DynamicCache()
    logits = target(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1).logits
    tokens, top2 = list(prompt), []
    while True:
        if settings.temperature <= 0:
            top2.append(torch.topk(logits[0, -1], 2).values)
        token = int(choose(logits[0, -1], settings.temperature, generator))  # CPU-GPU sync point: per token
        tokens.append(token)
        new = tokens[len(prompt):]
        if len(new) >= settings.max_new_tokens or token == settings.eos_token_id:
            break
        logits = target(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True).logits
    dt = time.perf_counter() - t0
    pairs = [tuple(v) for v in torch.stack(top2).float().tolist()] if top2 else []
    return DecodeResult(tokens[len(prompt):], [], dt, dt, 0.0, pairs)


# Where greedy speculative output may differ from plain greedy output without a bug. Verifying k+1 tokens in one
# forward and decoding one token per forward reduce in different orders, so every logit can move by a few units
# in the last place of its magnitude; where the target's top two logits are closer than that, either order can
# pick either token. A unit in the last place of x is eps * |x| at most (torch.finfo eps: 2^-7 for bfloat16, whose
# significand has 8 bits; 2^-10 for float16, 11 bits); FLIP_ULPS of them at the top logit's magnitude is the gap a
# dtype can flip. float32 (24 bits) and float64 stay exact: any divergence there is a decoder or export bug.
FLIP_ULPS = 4
EXACT_DTYPES = (torch.float32, torch.float64)


def flip_tolerance(dtype: torch.dtype, top: float) -> float:
    """The top-2 logit gap below which two decodes in `dtype` may choose differently (0: exact)."""
    if dtype in EXACT_DTYPES:
        return 0.0
    return FLIP_ULPS * torch.finfo(dtype).eps * max(abs(top), 1.0)


@dataclass(frozen=True)
class Divergence:
    """Where a greedy speculative output first leaves the target's own greedy output, and whether the target's
    top two logits there are close enough for the dtype's rounding to choose either."""

    sequence: int  # the decoded sequence's index in the run
    position: int  # the first generated token that differs
    gap: float | None  # the target's top-1 minus top-2 logit at that token (plain decode); None: no such step
    tolerance: float  # flip_tolerance at that token
    dtype: str
    near_tie: bool  # gap < tolerance: rounding, not a bug


def first_divergence(sequence: int, plain: DecodeResult, spec: list[int], dtype: torch.dtype) -> Divergence | None:
    """The first token where `spec` differs from the plain greedy decode `plain` (None: identical)."""
    if spec == plain.tokens:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec)) if a != b), min(len(plain.tokens), len(spec)))
    top = plain.top2[pos] if pos < len(plain.top2) else None
    gap = top[0] - top[1] if top else None
    tol = flip_tolerance(dtype, top[0]) if top else 0.0
    return Divergence(sequence, pos, gap, tol, str(dtype).removeprefix("torch."), gap is not None and gap < tol)
