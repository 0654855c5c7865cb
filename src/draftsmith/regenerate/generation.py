"""Batched decoding for regeneration: a static KV cache whose rows are refilled as they finish.

`regenerate` needs many independent continuations (answers, self-written user turns) from one target. The
usual `generate` call decodes a fixed batch until its longest member ends, so most rows idle on padding, and
on a GPU a small target is bound by kernel launches, not by the chip. `RowDecoder` fixes both:

- one KV cache of `rows x max_length` positions per layer, allocated once; every row has its own position,
  so a finished row is refilled with the next prompt while the others keep decoding (continuous batching);
- the decode step is pure tensor work on fixed-shape state (token, position, generated count, active flag,
  output buffer), so on CUDA it is captured as a CUDA graph and replayed: the host syncs only every
  `sync_every` steps to collect finished rows and refill them;
- decode attention on CUDA reads each row only up to its own length (cache_attention.py, one Triton kernel
  per layer, one graph for every length); the dense paths read the longest row's bucket (one graph per bucket);
- the target's own modules do the math (embedding, norms, q/k/v/o projections, MLP, head); this module owns
  only the cache, attention over it, RoPE at per-row positions, sampling, and the schedule.

Shapes: B rows, T prompt length (padded), L KV bucket length, H hidden, nh / kvh query / key-value heads,
g = nh // kvh, hd head dim, V vocabulary.

Supported: decoder-only models whose attention is Llama's (Llama, Mistral without sliding window, Qwen2);
`supports(model)` says so, and regenerate falls back to transformers' `generate` for the rest.

Run: `python benchmarks/bench_regenerate.py --device cuda` measures it against `generate`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError

SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")
ATTENTION = ("auto", "triton", "matmul", "sdpa")
BUCKET = 128  # KV-length granularity of the dense paths' CUDA graphs: they read ceil((max pos + sync_every) / 128) * 128


@dataclass(frozen=True)
class RowDecodeSettings:
    """How `RowDecoder` decodes."""

    max_new_tokens: int = 256
    """Cap on generated tokens per prompt (the end-of-turn token included)."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (exact: a full sort)."""
    rows: int = 256
    """Rows decoded together (the KV cache holds rows x max_length positions per layer)."""
    max_length: int = 2048
    """Prompt + generated tokens per row; longer prompts are refused, longer outputs are cut."""
    sync_every: int = 8
    """Decode steps between host checks (finished rows are collected and refilled then)."""
    prefill_tokens: int = 32768
    """Padded prompt tokens per prefill call."""
    cuda_graphs: bool = True
    """Capture the decode step as CUDA graphs (CUDA only)."""
    attention: str = "auto"
    """Decode attention over the cache: `triton` (CUDA: one kernel per layer that reads each row only up to its
    own length, cache_attention.py), `matmul` (explicit fp32 scores over the longest row's bucket), `sdpa` (one
    fused kernel per layer over that bucket; not faster than matmul: docs/regenerate.md), or `auto`: triton on
    CUDA where Triton imports, matmul elsewhere."""

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise DraftsmithError("unknown decode attention", got=repr(self.attention), expected=" or ".join(ATTENTION),
                                  fix="pick one of them")


@dataclass(frozen=True)
class Completion:
    """One prompt's continuation."""

    index: int
    """Position of the prompt in the input list."""
    token_ids: list[int]
    """Generated ids, the stop token excluded."""
    stopped: bool
    """True when a stop token ended it; False when max_new_tokens or max_length cut it."""


@dataclass(frozen=True)
class DecodeStats:
    prompts: int
    generated_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.seconds, 1e-9)


def supports(model) -> bool:
    """True when `RowDecoder` can run this transformers causal LM."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb"):
        return False
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        return False  # attention here spans the whole row; a sliding window would differ beyond its width
    return all(type(layer.self_attn).__name__ in SUPPORTED_ATTENTION for layer in layers)


def resolve_attention(name: str, device: torch.device) -> str:
    """The decode attention `name` means on `device`: `auto` becomes triton on CUDA when Triton imports, else
    matmul; triton anywhere else is refused."""
    if name not in ("auto", "triton"):
        return name
    if device.type == "cuda":
        try:
            import draftsmith.regenerate.cache_attention  # noqa: F401  (Triton comes with CUDA builds of torch)
            return "triton"
        except ImportError as e:
            if name == "triton":
                raise DraftsmithError("decode attention `triton` needs the triton package", got=str(e),
                                      expected="a CUDA build of torch (it ships Triton)",
                                      fix="install triton, or pick attention matmul") from e
            return "matmul"
    if name == "triton":
        raise DraftsmithError("decode attention `triton` runs on CUDA only", got=f"device {device}",
                              expected="a CUDA device", fix="pick attention matmul (or auto) on this device")
    return "matmul"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(B, V) logits -> (B,) ids: argmax at temperature 0, else Gumbel-max over the nucleus (graph-safe: no sync)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    # Gumbel-max: argmax(l + G) with G = -log(-log U) is a sample of softmax(l).
    gumbel = -torch.log(-torch.log(torch.rand_like(scaled).clamp_(min=1e-20, max=1.0 - 1e-7)))
    if top_p >= 1.0:
        return (scaled + gumbel).argmax(dim=-1)
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    beyond = (probs.cumsum(dim=-1) - probs) > top_p  # mass before this token already reaches top_p
    choice = (ordered.masked_fill(beyond, float("-inf")) + gumbel).argmax(dim=-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


class RowDecoder:
    """Continuous-batching decoder over a static KV cache (see the module docstring)."""

    def __init__(self, model, settings: RowDecodeSettings, stop_ids: list[int]):
        if not supports(model):
            raise DraftsmithError("the fast decoder does not support this model",
                                  got=type(model).__name__, expected=f"attention one of {SUPPORTED_ATTENTION}",
                                  fix="use transformers' generate (regenerate --decoder generate)")
        self.model, self.s = model, settings
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layers = model.model.layers
        self.nh, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.scale = self.layers[0].self_attn.scaling
        self.attention = resolve_attention(settings.attention, self.device)
        if self.attention == "triton":  # imported here: Triton exists only where CUDA does
            from draftsmith.regenerate.cache_attention import row_attention

            self.row_attention = row_attention
        B, M, n = settings.rows, settings.max_length, len(self.layers)
        self.k_cache = torch.zeros(n, B, self.kvh, M, self.hd, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        positions = torch.arange(M, device=self.device)[None]
        cos, sin = model.model.rotary_emb(self.k_cache[0, :1, 0], positions)
        self.cos, self.sin = cos[0], sin[0]  # (M, hd)
        self.stop = torch.tensor(sorted(set(stop_ids)), device=self.device, dtype=torch.long)
        # Decode state: fixed tensors the CUDA graphs read and write in place.
        self.tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(B, dtype=torch.long, device=self.device)
        self.n_new = torch.zeros(B, dtype=torch.long, device=self.device)
        self.active = torch.zeros(B, dtype=torch.bool, device=self.device)
        self.stopped = torch.zeros(B, dtype=torch.bool, device=self.device)
        self.out = torch.zeros(B, settings.max_new_tokens + 1, dtype=torch.long, device=self.device)  # last col: trash
        self.rows = torch.arange(B, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = settings.cuda_graphs and self.device.type == "cuda"

    # -- the math -------------------------------------------------------------------------------------

    def attend_decode(self, i: int, q: torch.Tensor, length: int, lengths: torch.Tensor) -> torch.Tensor:
        """q (B, nh, hd) of the current token; the cache row already holds its k/v. -> (B, nh * hd).

        `length`: the bucket the dense paths read; `lengths` (B,): each row's own (triton reads only those)."""
        B = q.shape[0]
        if self.attention == "triton":
            return self.row_attention(q, self.k_cache[i], self.v_cache[i], lengths, self.scale)
        keys = self.k_cache[i, :, :, :length]  # (B, kvh, L, hd)
        values = self.v_cache[i, :, :, :length]
        qg = q.view(B, self.kvh, self.nh // self.kvh, self.hd)  # head j reads kv head j // g (HF repeat_kv)
        visible = torch.arange(length, device=q.device)[None] <= self.pos[:, None]  # (B, L)
        if self.s.attention == "sdpa":  # the g query heads of a kv head act as g query positions of one head
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible[:, None, None, :], scale=self.scale)
            return out.reshape(B, self.nh * self.hd)  # (B, kvh, g, hd) -> (B, nh*hd)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # (B, kvh, g, L)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(B, self.nh * self.hd)  # (B, kvh, g, hd) -> (B, nh*hd)

    def decode_logits(self, length: int) -> torch.Tensor:
        """One token per row at its own position; writes the rows' k/v into the cache. -> (B, V)."""
        B = self.tokens.shape[0]
        x = self.model.model.embed_tokens(self.tokens)[:, None]  # (B, 1, H)
        cos, sin = self.cos[self.pos][:, None], self.sin[self.pos][:, None]  # (B, 1, hd)
        lengths = torch.where(self.active, self.pos + 1, 0)  # (B,) what each row sees; inactive rows read nothing
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, self.nh, self.hd)
            k = attn.k_proj(h).view(B, self.kvh, self.hd)
            v = attn.v_proj(h).view(B, self.kvh, self.hd)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k_cache[i, self.rows, :, self.pos] = k
            self.v_cache[i, self.rows, :, self.pos] = v
            x = x + attn.o_proj(self.attend_decode(i, q, length, lengths)[:, None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.model.model.norm(x[:, 0]))

    def step(self, length: int) -> None:
        """Decode one token for every active row (graph-safe: no host sync)."""
        s = self.s
        nxt = sample_next(self.decode_logits(length), s.temperature, s.top_p)
        col = torch.where(self.active, self.n_new, torch.full_like(self.n_new, s.max_new_tokens))
        self.out.scatter_(1, col[:, None], nxt[:, None])
        is_stop = torch.isin(nxt, self.stop)
        advance = self.active.long()
        self.n_new.add_(advance)
        self.pos.add_(advance)
        done = self.active & (is_stop | (self.n_new >= s.max_new_tokens) | (self.pos >= s.max_length - 1))
        self.stopped.logical_or_(self.active & is_stop)
        self.active.logical_and_(~done)
        self.tokens.copy_(torch.where(self.active, nxt, self.tokens))

    @torch.inference_mode()
    def prefill(self, rows: list[int], prompts: list[list[int]]) -> None:
        """Run the prompts through the target, write their k/v into `rows`, and sample each first token."""
        T = max(len(p) for p in prompts)
        R = len(rows)
        ids = torch.zeros(R, T, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        row_idx = torch.tensor(rows, device=self.device)
        x = self.model.model.embed_tokens(ids)  # (R, T, H); right padding: causal attention keeps rows exact
        cos, sin = self.cos[:T][None, None], self.sin[:T][None, None]  # (1, 1, T, hd)
        g = self.nh // self.kvh
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(R, T, self.nh, self.hd).transpose(1, 2)  # (R, nh, T, hd)
            k = attn.k_proj(h).view(R, T, self.kvh, self.hd).transpose(1, 2)  # (R, kvh, T, hd)
            v = attn.v_proj(h).view(R, T, self.kvh, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k_cache[i, row_idx, :, :T] = k
            self.v_cache[i, row_idx, :, :T] = v
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                               is_causal=True, scale=self.scale)  # (R, nh, T, hd)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(R, T, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(R, device=self.device), lengths - 1]  # (R, H)
        first = sample_next(self.model.lm_head(self.model.model.norm(last)), self.s.temperature, self.s.top_p)
        is_stop = torch.isin(first, self.stop)
        self.out[row_idx, 0] = first
        self.tokens[row_idx] = first
        self.pos[row_idx] = lengths
        self.n_new[row_idx] = 1
        self.stopped[row_idx] = is_stop
        self.active[row_idx] = ~is_stop & (self.s.max_new_tokens > 1)

    # -- CUDA graphs ----------------------------------------------------------------------------------

    def replay(self, length: int) -> None:
        if not self.use_graphs:
            self.step(length)
            return
        graph = self.graphs.get(length)
        if graph is None:
            graph = self.capture(length)
        graph.replay()

    def capture(self, length: int) -> "torch.cuda.CUDAGraph":
        """Capture `step(length)` as a graph. Warm-up runs on a side stream change the state of inactive rows
        only in ways the next prefill overwrites; the active flags are saved and restored around it."""
        saved = [t.clone() for t in (self.tokens, self.pos, self.n_new, self.active, self.stopped, self.out)]
        self.active.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            self.step(length)
        for t, v in zip((self.tokens, self.pos, self.n_new, self.active, self.stopped, self.out), saved):
            t.copy_(v)
        self.graphs[length] = graph
        return graph

    # -- the schedule ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], progress=None) -> Iterator[Completion]:
        """Yield one Completion per prompt, in the order they finish.

        Args:
            prompts: token ids per prompt (each shorter than max_length).
            progress: optional callable(done_prompts, generated_tokens) called at each host sync.
        """
        s = self.s
        too_long = [i for i, p in enumerate(prompts) if not 0 < len(p) < s.max_length]
        if too_long:
            i = too_long[0]
            raise DraftsmithError("a prompt does not fit the decoder's rows", got=f"prompt {i}: {len(prompts[i])} tokens",
                                  expected=f"1 to {s.max_length - 1} tokens", fix="raise --max-length or drop that prompt")
        queue = deque(range(len(prompts)))
        owner: dict[int, int] = {}  # row -> prompt index
        free = list(range(s.rows))
        self.active.zero_()
        done = tokens = 0
        while queue or owner:
            if free and queue and (len(free) >= max(1, s.rows // 32) or not owner or len(queue) < len(free)):
                self.refill(free, queue, owner, prompts)
            if owner:
                length = self.bucket()
                for _ in range(s.sync_every):
                    self.replay(length)
            active = self.active.tolist()  # CPU-GPU sync point
            finished = [r for r in owner if not active[r]]
            if finished:
                n_new = self.n_new[finished].tolist()
                stopped = self.stopped[finished].tolist()
                rows_out = self.out[finished].tolist()
                for r, n, stop, row in zip(finished, n_new, stopped, rows_out):
                    ids = row[:n - 1] if stop else row[:n]
                    tokens += n
                    done += 1
                    yield Completion(owner.pop(r), ids, bool(stop))
                    free.append(r)
                if progress:
                    progress(done, tokens)

    def bucket(self) -> int:
        """The KV length the next sync_every steps read: the longest active row's, rounded up to BUCKET, for the
        dense paths; the whole cache for triton, which stops at each row's own length (so one graph serves all)."""
        s = self.s
        if self.attention == "triton":
            return s.max_length
        longest = int((self.pos * self.active).max())  # CPU-GPU sync point: once per sync_every steps
        return min(s.max_length, -(-(longest + s.sync_every + 1) // BUCKET) * BUCKET)

    def refill(self, free: list[int], queue: deque, owner: dict[int, int], prompts: list[list[int]]) -> None:
        """Prefill queued prompts into free rows, in calls of at most `prefill_tokens` padded tokens."""
        take = []
        while free and queue:
            take.append((free.pop(), queue.popleft()))
        take.sort(key=lambda rp: len(prompts[rp[1]]))  # similar lengths share a call: less padding
        start = 0
        while start < len(take):
            end = start + 1
            while end < len(take) and len(prompts[take[end][1]]) * (end + 1 - start) <= self.s.prefill_tokens:
                end += 1
            chunk = take[start:end]
            self.prefill([r for r, _ in chunk], [prompts[p] for _, p in chunk])
            owner.update(dict(chunk))
            start = end


def decode_all(model, prompts: list[list[int]], settings: RowDecodeSettings, stop_ids: list[int],
               progress=None) -> tuple[list[Completion], DecodeStats]:
    """Every prompt's Completion, in input order, and the run's throughput (seed with torch.manual_seed first:
    one seed covers prefill and graph replays alike)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    decoder = RowDecoder(model, settings, stop_ids)
    results: list[Completion | None] = [None] * len(prompts)
    for c in decoder.run(prompts, progress):
        results[c.index] = c
    seconds = time.perf_counter() - t0
    generated = sum(len(c.token_ids) + c.stopped for c in results)
    return results, DecodeStats(len(prompts), generated, seconds)
