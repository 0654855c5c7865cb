"""Capture in draftsmith's own process: run the target over conversations and keep what training needs.

For each conversation: tokenize with the target's chat template (`draftsmith.regenerate.chat`), run the target
once, keep the hidden states at the three aux ids (boundary indices) and the final post-norm hidden
state, and count the supervised tokens for the draft vocabulary. Samples go to a feature store
(`draftsmith.capture.store`) in the order of the conversations file, so a killed capture resumes after the
last complete shard.

`target_features` is shared with online training: the same tensors, computed in the training process.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field

from draftsmith.regenerate.chat import TokenizedSample, tokenize_conversation
from draftsmith.config import Settings
from draftsmith.regenerate.conversations import check_conversations, read_conversations
from draftsmith.errors import DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.capture.store import AUX_CONVENTION, Sample, StoreWriter, bytes_per_token, sha256_file
from draftsmith.target import describe_target, load_target, read_config, resolve_target, target_argmax, target_aux_ids

DEFAULT_MAX_LENGTH = 2048  # SpecForge schema / EAGLE default (docs/training.md §8)
DEFAULT_MAX_BYTES = 1 << 30  # engine capture's connector folder budget; in flight = concurrency x bytes per request


@dataclass(frozen=True)
class TargetFeatures:
    """What the drafter learns from, per token. aux (B, T, 3H), last (B, T, H), target_argmax (B, T)."""

    aux: torch.Tensor
    last: torch.Tensor
    target_argmax: torch.Tensor


def target_identity(model_dir: Path, name: str) -> dict:
    """Identity of a target: its name and the sha256 of its config.json (what a store is tied to)."""
    config = read_config(model_dir)
    spec = describe_target(config)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"name": name, "config_sha256": digest, "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size, "model_type": spec.model_type, "spec": spec.to_dict()}


@torch.inference_mode()
def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    aux_ids: tuple[int, ...]) -> TargetFeatures:
    """One target forward: the aux states, the final (post-norm) hidden state and the argmax of its logits.

    Args:
        input_ids: (B, T).
        attention_mask: (B, T), or None for right-padded rows (`pad_batch`'s): under causal attention a real
            position never sees the padding after it, and positions count from 0 either way, so the real
            positions' features are the same without the mask, and attention runs its causal kernels (flash on
            CUDA) instead of a masked one. What the padding positions get is then not defined: callers drop it.
        aux_ids: boundary indices into HF `output_hidden_states`.
    """
    body = model.model
    n_layers = len(body.layers)
    got: dict[int, torch.Tensor] = {}

    def keep(k: int):
        def hook(module, args, output):
            got[k] = output[0] if isinstance(output, tuple) else output
        return hook

    # Boundary index k is HF's hidden_states[k]: the embeddings for 0, the output of layer k-1 below N, and
    # the final (post-norm) state for N. Hooks on just those modules instead of output_hidden_states=True,
    # which records every layer (3 % of a SmolLM2 forward on CPU).
    handles = [(body.embed_tokens if k == 0 else body.layers[k - 1]).register_forward_hook(keep(k))
               for k in set(aux_ids) if k < n_layers]
    try:
        out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    last = out.last_hidden_state  # (B, T, H), after the final norm
    aux = torch.cat([got[k] if k < n_layers else last for k in aux_ids], dim=-1)  # (B, T, 3H)
    argmax = target_argmax(last, model.get_output_embeddings().weight)  # (B, T), the logits in row chunks
    return TargetFeatures(aux=aux, last=last, target_argmax=argmax)


def tokenized_conversations(path: Path, tokenizer, max_length: int,
                            workers: int | None = None) -> list[tuple[str, TokenizedSample]]:
    """Tokenize every conversation that has at least one supervised token, in file order.

    Rendering and offset tokenization cost milliseconds per conversation, so large files are tokenized by a
    pool of forked processes (`workers`, default: up to 16 cores for files of 2,000 conversations or more).
    """
    convs = list(read_conversations(path))
    workers = workers or (min(16, os.cpu_count() or 1) if len(convs) >= PARALLEL_FROM else 1)
    if workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool parallelises; no threads per fork
        with multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer, max_length)) as pool:
            tokenized = pool.map(_tokenize_in_worker, [c.messages for c in convs], chunksize=64)
    else:
        tokenized = [tokenize_conversation(tokenizer, c.messages, max_length) for c in convs]
    return [(c.id, s) for c, s in zip(convs, tokenized) if s.num_supervised > 0]


PARALLEL_FROM = 2000
_WORKER: dict = {}


def _init_worker(tokenizer, max_length: int) -> None:
    _WORKER.update(tokenizer=tokenizer, max_length=max_length)


def _tokenize_in_worker(messages) -> TokenizedSample:
    return tokenize_conversation(_WORKER["tokenizer"], messages, _WORKER["max_length"])


def batches_by_tokens(samples: list[TokenizedSample], max_tokens: int) -> list[list[int]]:
    """Contiguous groups of sample indices whose padded size stays under `max_tokens`."""
    return group_by_tokens([len(s.input_ids) for s in samples], max_tokens)


def group_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Contiguous groups of positions 0..len-1 whose padded size (longest x count) stays under `max_tokens`."""
    groups, current, longest = [], [], 0
    for i, length in enumerate(lengths):
        n = min(length, max_tokens)
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def pad_batch(samples: list[TokenizedSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to (B, T): input_ids, attention_mask, loss_mask. The target needs no attention mask for such
    rows (`target_features`); the mask marks the real tokens for the rest."""
    T = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(samples), T), dtype=torch.long)
    loss = torch.zeros((len(samples), T), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        att[b, :n] = 1
        loss[b, :n] = torch.tensor(s.loss_mask)
    return ids, att, loss


@dataclass(frozen=True)
class CaptureSummary:
    samples: int
    """Samples captured by this call (0: the store was already complete)."""
    skipped_done: int
    """Samples already in the store before this call."""
    tokens: int
    """Tokens captured by this call."""
    seconds: float
    bytes_per_token: int


def require_conversations(conversations: Path | None) -> None:
    """The conversations file exists and parses whole (each bad line a named error) before a target or an engine
    is started."""
    if conversations is None or not Path(conversations).is_file():
        raise DraftsmithError("conversations file not found", got=str(conversations),
                              expected="a JSONL written by `draftsmith regenerate` (--conversations)",
                              fix="run regenerate first")
    count, supervised = check_conversations(Path(conversations))  # every line parsed, each bad one named
    if count == 0:
        raise DraftsmithError("the conversations file holds no conversation", got=f"{conversations} is empty",
                              expected="one JSON conversation per line, as `draftsmith regenerate` writes",
                              fix="run regenerate first, or pass the file it wrote as --conversations")
    if not supervised:
        raise DraftsmithError("the conversations file holds no assistant turn: nothing to train a drafter on",
                              got=f"{count} conversations in {conversations}, none with a message of role assistant",
                              expected="conversations with assistant answers, as `draftsmith regenerate` writes",
                              fix="run regenerate on these prompts first, and pass the file it wrote as --conversations")


def require_samples(samples: list, conversations: Path, max_length: int) -> None:
    """Refuse conversations whose assistant turns yield no supervised token once tokenized (empty answers, or
    answers past --max-length), before a store or a drafter is written."""
    if not samples:
        raise DraftsmithError("the conversations yield no trainable sample", got=f"{conversations}: no assistant "
                              f"token within the first {max_length} tokens of any conversation",
                              expected="at least one conversation with a non-empty assistant answer within "
                                       "--max-length", fix="raise --max-length, or regenerate the answers")


def capture_identity(model_dir: Path, target: str, aux_ids: tuple[int, ...], spec, max_length: int,
                     conversations: Path) -> dict:
    """What a store is tied to; the same for the in-process and the engine capture, so either resumes either."""
    return {"target": target_identity(model_dir, target), "aux_layer_ids": list(aux_ids),
            "aux_id_convention": AUX_CONVENTION, "hidden_size": spec.hidden_size, "dtype": "bfloat16",
            "max_length": max_length, "conversations_sha256": sha256_file(conversations), "chat_template": "target"}


def supervised_counts(samples: list[TokenizedSample], vocab_size: int) -> torch.Tensor:
    """How often each target token is supervised, over every sample (those a killed run stored included)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.tensor(s.input_ids)
        counts += torch.bincount(ids[torch.tensor(s.loss_mask, dtype=torch.bool)], minlength=vocab_size)
    return counts


def head_tensors(embed: torch.Tensor, head: torch.Tensor) -> dict[str, torch.Tensor]:
    """The frozen target tensors a store keeps (bf16)."""
    return {"embed_tokens": embed.detach().to(torch.bfloat16).clone(), "lm_head": head.detach().to(torch.bfloat16).clone()}


def finish_store(writer: StoreWriter, counts: torch.Tensor, embed: torch.Tensor, head: torch.Tensor,
                 hidden_size: int) -> None:
    """Last shard, token counts and the frozen target head (bf16); marks the store complete."""
    writer.finish(counts, head_tensors(embed, head),
                  {"bytes_per_token": bytes_per_token(hidden_size), "token_counts_total": int(counts.sum())})


def parse_ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise DraftsmithError("bad --aux-ids", got=repr(text), expected="comma-separated integers like 2,15,27",
                              fix="pass three boundary indices, or omit the flag for the default") from exc


CAPTURE_ENGINES = ("transformers", "vllm")
CAPTURE_DTYPES = ("float32", "bfloat16", "auto")  # the verb's choices; run's section also passes others to vLLM's --dtype


class CaptureSettings(Settings):
    """How `capture` runs the target: the capture verb's flags and `run`'s capture section."""

    engine: str = "transformers"
    """transformers: the target runs in draftsmith's own process (device, batch_tokens); vllm: capture through a
    vLLM server with `extract_hidden_states` (engine_capture), started with tensor_parallel (by run: from
    engine_python), or the one already serving at endpoint."""
    max_length: int = Field(DEFAULT_MAX_LENGTH, ge=1)
    """Truncate conversations to this many tokens (run: also used by online training)."""
    dtype: str = "float32"
    """Target compute dtype while capturing: float32 | bfloat16 | auto (bfloat16 on CUDA and on CPUs that compute it
    natively, else float32); the store holds bfloat16 either way (engine vllm: the server's --dtype)."""
    device: str = "cpu"
    """engine transformers: where the target runs."""
    batch_tokens: int = Field(4096, ge=1)
    """engine transformers: padded tokens per target forward."""
    endpoint: str | None = None
    """engine vllm: a running capture server, started with the flags `draftsmith capture --print-server-args`
    prints (null: one is started, and stopped after the capture)."""
    tensor_parallel: int = Field(1, ge=1)
    """engine vllm: tensor-parallel size of the server that is started."""
    hs_dir: str | None = None
    """engine vllm: the connector's folder (null: STORE/engine/hs, STORE being --out or run's OUT/store); a fast
    local disk or /dev/shm."""
    hs_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1)
    """engine vllm: bytes the connector folder may hold (in flight: about concurrency x bytes per request)."""
    concurrency: int = Field(4, ge=1)
    """engine vllm: requests in flight."""
    max_store_bytes: int | None = Field(None, ge=1)
    """Back-pressure for a store that a trainer follows (`train --follow --delete-consumed`): the capture waits
    before a shard that would put more than this many shard bytes on disk (null: no limit)."""
    store_wait_timeout_s: float = Field(3600.0, gt=0)
    """With max_store_bytes: how long the capture waits for room before it stops with the reason."""


def capture(conversations: Path, out: Path, settings: CaptureSettings | None = None, *, target: str = "smollm2",
            aux_ids: tuple[int, ...] | None = None, shard_tokens: int = 1 << 16, family: str = "eagle3") -> CaptureSummary:
    """Capture a feature store from a conversations file in this process (resumes an interrupted capture).

    `settings` is the capture verb's (and run's capture section's) model, passed whole: max_length, dtype, device,
    batch_tokens, max_store_bytes, store_wait_timeout_s are read from it.
    """
    s = settings or CaptureSettings()
    max_length, batch_tokens, dtype, device = s.max_length, s.batch_tokens, s.dtype, s.device
    model_dir = resolve_target(target)
    spec = describe_target(read_config(model_dir))
    aux_ids = target_aux_ids(target, spec, aux_ids, family)
    require_conversations(conversations)
    writer = StoreWriter(out, capture_identity(model_dir, target, aux_ids, spec, max_length, Path(conversations)),
                         shard_tokens, s.max_store_bytes, s.store_wait_timeout_s)
    if writer.manifest.get("complete"):
        m = writer.manifest
        return CaptureSummary(0, m["num_samples"], 0, 0.0, bytes_per_token(spec.hidden_size))  # a finished store
    model, tokenizer = load_target(model_dir, dtype=dtype, device=device)
    samples = [s for _, s in tokenized_conversations(Path(conversations), tokenizer, max_length)]
    require_samples(samples, Path(conversations), max_length)
    skip = writer.samples_done
    counts = supervised_counts(samples, spec.vocab_size)
    writer.publish(counts, head_tensors(model.get_input_embeddings().weight, model.get_output_embeddings().weight))
    todo = samples[skip:]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start, tokens = time.perf_counter(), 0
    with progress_bar("capture", total=len(todo), unit="samples") as bar:
        for group in batches_by_tokens(todo, batch_tokens):
            batch = [todo[i] for i in group]
            ids, _, loss = pad_batch(batch, pad)
            feats = target_features(model, ids.to(device), None, aux_ids)  # right-padded: no mask needed
            aux, last = feats.aux.to("cpu", torch.bfloat16), feats.last.to("cpu", torch.bfloat16)
            argmax = feats.target_argmax.cpu()  # one copy a batch, not one device sync a sample
            for b, s in enumerate(batch):
                n = len(s.input_ids)
                writer.add(Sample(ids[b, :n], loss[b, :n], aux[b, :n], last[b, :n], argmax[b, :n]))
                tokens += n
            bar.advance(len(batch), tokens=tokens)
    finish_store(writer, counts, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                 spec.hidden_size)
    return CaptureSummary(len(todo), skip, tokens, time.perf_counter() - start, bytes_per_token(spec.hidden_size))


def print_summary(s: CaptureSummary, out: Path) -> None:
    if s.samples == 0:
        print(f"capture: nothing to do: the store is complete, all {s.skipped_done} samples already stored -> {out}")
        return
    rate = s.tokens / max(s.seconds, 1e-9)
    print(f"capture: {s.samples} samples ({s.skipped_done} already stored), {s.tokens} tokens in {s.seconds:.1f} s "
          f"({rate:,.0f} tok/s); {s.bytes_per_token} bytes/token -> {out}")
