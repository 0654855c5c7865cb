"""Reference speculative decoder: a Hugging Face target plus a draftsmith EAGLE-3 drafter.

Small functions per phase, in the order one iteration runs them (gpt-fast style):

    prefill   target over the prompt -> first token and the aux features of every prompt position
    draft     drafter: catch up on newly committed positions (true target features), then k chain steps
    verify    target over [last token, d_1..d_k] with its KV cache -> logits and aux features
    commit    accept a prefix, add the bonus token, roll both KV caches back to what was accepted

Decode state is explicit (`DecodeState`). Invariant between iterations: the target has processed
every committed token but the last (`next_token`); the drafter's cache holds entries for positions
< `drafter_len`, each made from the target's true features; `pending_aux` holds the target features of
positions drafter_len .. committed-1, which the next draft's first step consumes (as vLLM does).

Acceptance (Leviathan et al. 2023): greedy accepts d_j while it equals the target's argmax; sampling
accepts d_j with probability min(1, p(d_j) / q(d_j)) and on rejection draws from norm(max(0, p - q)),
which leaves the target's distribution unchanged.

Aux ids are read the way a chosen engine reads them (`engine_aux_ids`), so a drafter whose ids the
engine misreads shows the collapsed acceptance it will have in production.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftsmith.drafter import Eagle3Drafter, apply_rope, rope_cos_sin
from draftsmith.target import default_aux_ids


@dataclass
class DrafterCache:
    """The drafter's single-layer KV cache. keys/values (1, nkv, L, hd); `length` valid entries."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys[:, :, :self.length], k], dim=2)
            self.values = torch.cat([self.values[:, :, :self.length], v], dim=2)
        self.length = self.keys.shape[2]
        return self.keys, self.values

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class DecodeState:
    """Everything one sequence's decoding carries between iterations."""

    tokens: list[int]
    """Committed tokens (prompt included); the last one is `next_token`, not yet seen by the target."""
    prompt_len: int
    target_cache: object
    drafter_cache: DrafterCache
    drafter_len: int
    pending_aux: torch.Tensor
    """(1, n, 3Ht) target features of positions drafter_len .. len(tokens)-2."""
    accepted: list[int] = field(default_factory=list)
    """Accepted draft tokens per verification step."""


@dataclass(frozen=True)
class DecodeSettings:
    k: int = 4
    temperature: float = 0.0
    max_new_tokens: int = 128
    eos_token_id: int | None = None


def engine_aux_ids(drafter_config: dict, target_layers: int, engine: str) -> tuple[int, ...]:
    """The boundary indices an engine captures for a drafter config.json (DESIGN.md, "Conventions").

    vLLM reads explicit ids as boundary indices; SGLang adds 1; both fall back to (2, N//2, N-3) when
    the drafter names none. `engine="trained"` returns the ids the drafter was trained with.
    """
    ids = config_aux_ids(drafter_config)
    if engine == "trained":
        block = drafter_config.get("draftsmith", {})
        return tuple(block.get("aux_layer_ids_boundary") or ids or default_aux_ids(target_layers))
    if not ids:
        return default_aux_ids(target_layers)
    return tuple(i + 1 for i in ids) if engine == "sglang" else tuple(ids)


def config_aux_ids(config: dict) -> list[int] | None:
    """Explicit aux ids in a drafter config: top level first, then eagle_config (vLLM's order)."""
    return config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")


# --- phases ---------------------------------------------------------------------------------------------

def target_step(target, ids: torch.Tensor, cache, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target forward over new tokens (1, n) with its cache -> logits (1, n, V), aux (1, n, 3Ht)."""
    out = target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)
    return out.logits, aux


def drafter_step(drafter: Eagle3Drafter, ids: torch.Tensor, h: torch.Tensor, start: int,
                 cache: DrafterCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter forward over n new positions start..start+n-1 with its cache.

    Args:
        ids: (1, n) tokens fed; h: (1, n, H) hidden states fed (fc(aux) or the drafter's own output).
    Returns:
        logits (1, n, Vd), h_out (1, n, H) pre-norm.
    """
    cfg = drafter.config
    x, residual = drafter.midlayer.attention_input(drafter.embed_tokens(ids), h)  # (1, n, 2H)
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    q, k, v = drafter.midlayer.self_attn.project(x, cos.to(x.dtype), sin.to(x.dtype))
    keys, values = cache.append(k, v)  # (1, nkv, L, hd)
    groups = cfg.num_heads // cfg.num_kv_heads
    n, L = ids.shape[1], keys.shape[2]
    mask = torch.ones(n, L, dtype=torch.bool, device=ids.device).tril(diagonal=L - n)  # causal, bottom-right
    attn = F.scaled_dot_product_attention(q, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
                                          attn_mask=mask)  # (1, nh, n, hd)
    attn = drafter.midlayer.self_attn.o_proj(attn.transpose(1, 2).reshape(1, n, -1))
    h_out = drafter.midlayer.finish(attn, residual)
    return drafter.lm_head(drafter.norm(h_out)), h_out


def draft_logits_to_target(drafter: Eagle3Drafter, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter draft-vocabulary logits (.., Vd) into the target vocabulary (.., V), -inf elsewhere (as vLLM)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., torch.arange(logits.shape[-1], device=logits.device) + drafter.d2t] = logits
    return full


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """Greedy argmax, or a sample at `temperature`; returns (token, probabilities or None)."""
    if temperature <= 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


@torch.inference_mode()
def prefill(target, drafter: Eagle3Drafter, prompt: list[int], aux_ids: tuple[int, ...], settings: DecodeSettings,
            generator: torch.Generator | None = None) -> DecodeState:
    """Run the target over the prompt and choose the first new token."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt], device=next(target.parameters()).device)
    logits, aux = target_step(target, ids, cache, aux_ids)
    token, _ = pick(logits[0, -1], settings.temperature, generator)
    return DecodeState(tokens=list(prompt) + [token], prompt_len=len(prompt), target_cache=cache,
                       drafter_cache=DrafterCache(), drafter_len=0, pending_aux=aux)


@torch.inference_mode()
def draft(drafter: Eagle3Drafter, state: DecodeState, k: int, vocab_size: int, temperature: float,
          generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor | None]]:
    """Catch the drafter up on committed positions, then propose k tokens (a chain).

    Returns:
        (draft tokens d_1..d_k, their drafter distributions q over the target vocabulary when sampling).
    """
    start = state.drafter_len
    n = state.pending_aux.shape[1]
    device = state.pending_aux.device
    ids = torch.tensor([state.tokens[start + 1: start + 1 + n]], device=device)  # next tokens, (1, n)
    logits, h = drafter_step(drafter, ids, drafter.fc(state.pending_aux), start, state.drafter_cache)
    state.drafter_len = start + n  # these entries were made from true target features
    tokens, dists = [], []
    pos = start + n
    for j in range(k):
        full = draft_logits_to_target(drafter, logits[0, -1], vocab_size)
        token, q = pick(full, temperature, generator)
        tokens.append(token)
        dists.append(q)
        if j == k - 1:
            break
        logits, h = drafter_step(drafter, torch.tensor([[token]], device=device), h[:, -1:], pos, state.drafter_cache)
        pos += 1
    return tokens, dists


@torch.inference_mode()
def verify(target, state: DecodeState, drafts: list[int], aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target over [next_token, d_1..d_k]: logits (k+1, V) and aux features (1, k+1, 3Ht)."""
    device = state.pending_aux.device
    ids = torch.tensor([[state.tokens[-1]] + drafts], device=device)
    logits, aux = target_step(target, ids, state.target_cache, aux_ids)
    return logits[0], aux


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """Accept d_j while it is the target's argmax; returns (accepted count a, bonus token)."""
    best = logits.argmax(-1).tolist()  # CPU-GPU sync point: once per verification
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return a, best[a]


def accept_sampling(drafts: list[int], dists: list[torch.Tensor], logits: torch.Tensor, temperature: float,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling: q >= p: accept with prob p/q; p > q: accept (ratio >= 1)."""
    p_all = torch.softmax(logits.float() / temperature, dim=-1)  # (k+1, V)
    for j, (d, q) in enumerate(zip(drafts, dists)):
        p, qd = p_all[j], q
        ratio = float(p[d] / qd[d]) if float(qd[d]) > 0 else 0.0
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            continue
        residual = torch.clamp(p - qd, min=0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), int(torch.multinomial(p_all[len(drafts)], 1, generator=generator))


def commit(state: DecodeState, drafts: list[int], accepted: int, bonus: int, aux: torch.Tensor) -> None:
    """Keep [next_token, d_1..d_a], roll the caches back, queue the accepted positions' features."""
    state.tokens += drafts[:accepted] + [bonus]
    processed = len(state.tokens) - 1  # the target has now seen every token but the bonus
    excess = state.target_cache.get_seq_length() - processed
    if excess > 0:
        state.target_cache.crop(-excess)  # negative = drop that many (the only form every transformers accepts)
    state.drafter_cache.crop(state.drafter_len)
    state.pending_aux = aux[:, :accepted + 1]
    state.accepted.append(accepted)


def finished(state: DecodeState, settings: DecodeSettings) -> bool:
    new = state.tokens[state.prompt_len:]
    return len(new) >= settings.max_new_tokens or (settings.eos_token_id is not None and settings.eos_token_id in new)


def trim(state: DecodeState, settings: DecodeSettings) -> list[int]:
    """The generated tokens, cut at max_new_tokens and after the first EOS."""
    new = state.tokens[state.prompt_len:][:settings.max_new_tokens]
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


def speculative_decode(target, drafter: Eagle3Drafter, prompt: list[int], aux_ids: tuple[int, ...],
                       settings: DecodeSettings, seed: int = 0) -> DecodeResult:
    """Decode one prompt with EAGLE-3 chain drafting; returns the tokens and per-step acceptance."""
    generator = torch.Generator().manual_seed(seed) if settings.temperature > 0 else None
    vocab = target.config.get_text_config().vocab_size
    t0 = time.perf_counter()
    state = prefill(target, drafter, prompt, aux_ids, settings, generator)
    t_target, t_drafter = time.perf_counter() - t0, 0.0
    while not finished(state, settings):
        t1 = time.perf_counter()
        drafts, dists = draft(drafter, state, settings.k, vocab, settings.temperature, generator)
        t2 = time.perf_counter()
        logits, aux = verify(target, state, drafts, aux_ids)
        if settings.temperature > 0:
            accepted, bonus = accept_sampling(drafts, dists, logits, settings.temperature, generator)
        else:
            accepted, bonus = accept_greedy(drafts, logits)
        t3 = time.perf_counter()
        commit(state, drafts, accepted, bonus, aux)
        t_drafter += t2 - t1
        t_target += t3 - t2
    return DecodeResult(trim(state, settings), state.accepted, time.perf_counter() - t0, t_target, t_drafter)


@torch.inference_mode()
def target_decode(target, prompt: list[int], settings: DecodeSettings, seed: int = 0) -> DecodeResult:
    """Plain autoregressive decoding with the same cache and step functions: the speed-up baseline."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed) if settings.temperature > 0 else None
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    cache = DynamicCache()
    logits = target(input_ids=torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True).logits
    tokens = list(prompt)
    while True:
        token, _ = pick(logits[0, -1], settings.temperature, generator)
        tokens.append(token)
        new = tokens[len(prompt):]
        if len(new) >= settings.max_new_tokens or token == settings.eos_token_id:
            break
        logits = target(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True).logits
    dt = time.perf_counter() - t0
    return DecodeResult(tokens[len(prompt):], [], dt, dt, 0.0)
