"""Where training features come from: a feature store (offline) or the target itself (online).

Both sources give the trainer the same `Batch`, so one loop serves both modes: padded (`batch`: one
sample per row, padded to the longest) or packed (`packed_batch`: rows of a fixed length filled with
whole documents back to back, `pack_rows`), whose shape never changes during a run.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from draftsmith.capture.local import (TargetFeatures, pad_batch, require_conversations, require_samples, target_features, target_identity,
                                      tokenized_conversations)
from draftsmith.regenerate.chat import TokenizedSample
from draftsmith.capture.store import FeatureStore, Sample
from draftsmith.target import TargetSpec, describe_target, load_target, read_config, resolve_target, target_aux_ids


@dataclass
class Batch:
    """input_ids, loss_mask, target_argmax (B, T); aux (B, T, n Ht) (n aux layers: 3 for EAGLE-3); last (B, T, Ht) the target's final normed state;
    documents (B, T) for packed rows: each token's document number within its row (None: one sample per row)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    target_argmax: torch.Tensor
    documents: torch.Tensor | None = None


Segment = tuple[int, int, int]
"""(sample index, start, end): tokens [start, end) of one sample, one document of a packed row."""


def pack_rows(rows: list[list[Segment]], row_tokens: int, sample: Callable[[int], Sample], device: torch.device,
              dtype: torch.dtype) -> Batch:
    """Packed rows (len(rows), row_tokens): each row's segments back to back, then zeros.

    Documents are numbered 0, 1, ... per row in order; the padding after them is one more document, so
    that it attends only to itself. A row may be empty (all padding: it keeps the micro-batch's shape).
    `sample(k)` gives sample k's full-length tensors, on any device; the batch is built there.
    """
    segments = [seg for row in rows for seg in row]
    assert segments, "pack_rows needs at least one segment"
    first = sample(segments[0][0])
    B, R, Ht, at = len(rows), row_tokens, first.last.shape[-1], first.last.device
    # Built on the CPU for a CUDA device: in pinned memory, so that the copies below are asynchronous (on a
    # pageable source each one waits for the device: 20 ms of a SmolLM2 step at 8,192 tokens on an H200).
    pin = at.type == "cpu" and device.type == "cuda"
    new = functools.partial(torch.zeros, device=at, pin_memory=pin)
    ids, mask, argmax = (new(B, R, dtype=torch.long) for _ in range(3))
    aux = new(B, R, first.aux.shape[-1], dtype=dtype)
    last = new(B, R, Ht, dtype=dtype)
    documents = new(B, R, dtype=torch.long)
    for b, row in enumerate(rows):
        t = 0
        for j, (k, start, end) in enumerate(row):
            s, n = sample(k), end - start
            assert t + n <= R, f"row {b} overflows: {t} + {n} > {R}"
            ids[b, t:t + n], mask[b, t:t + n] = s.input_ids[start:end], s.loss_mask[start:end]
            argmax[b, t:t + n], documents[b, t:t + n] = s.target_argmax[start:end], j
            aux[b, t:t + n], last[b, t:t + n] = s.aux[start:end], s.last[start:end]
            t += n
        documents[b, t:] = len(row)
    return Batch(*(t.to(device, non_blocking=pin) for t in (ids, mask, aux, last, argmax, documents)))


class FeatureSource(Protocol):
    target_spec: TargetSpec
    target_name: str
    aux_ids: tuple[int, ...]
    lengths: list[int]

    def __len__(self) -> int: ...
    def batch(self, indices: list[int], device: torch.device) -> Batch: ...
    def packed_batch(self, rows: list[list[Segment]], row_tokens: int, device: torch.device) -> Batch: ...
    def loss_mask(self, k: int) -> torch.Tensor: ...
    def target_head(self) -> torch.Tensor: ...
    def embed_tokens(self) -> torch.Tensor: ...
    def token_counts(self) -> torch.Tensor: ...


def feature_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there); bf16 on GPU, where training runs under autocast."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class StoreSource:
    """Offline features from a verified, memory-mapped feature store."""

    def __init__(self, root: Path, follow: bool = False):
        """`follow`: the store may still be written (`train --follow`): `refresh()` adds the shards that land."""
        self.store = FeatureStore(root, follow=follow)
        ident = self.store.identity
        spec = dict(ident["target"]["spec"])
        spec["architectures"] = tuple(spec["architectures"])
        self.target_spec = TargetSpec(**spec)
        self.target_name = ident["target"]["name"]
        self.aux_ids = tuple(ident["aux_layer_ids"])
        self.lengths = ([n for e in self.store.manifest["shards"] for n in e["lengths"]] if follow else
                        [self.store.sample_length(k) for k in range(len(self.store))])
        self._tensors = self.store.target_tensors()

    def refresh(self) -> list[dict]:
        """Follow mode: the manifest entries of the shards that landed since the last call."""
        new = self.store.refresh()
        self.lengths += [n for e in new for n in e["lengths"]]
        return new

    def __len__(self) -> int:
        return len(self.store)

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        samples = [self.store.sample(k) for k in indices]
        T = max(len(s.input_ids) for s in samples)
        B, Ht = len(samples), samples[0].last.shape[-1]
        # In pinned memory for a CUDA device, as pack_rows: a copy from pageable memory waits for the device.
        pin = device.type == "cuda"
        new = functools.partial(torch.zeros, pin_memory=pin)
        ids, mask, argmax = (new(B, T, dtype=torch.long) for _ in range(3))
        aux = new(B, T, samples[0].aux.shape[-1], dtype=feature_dtype(device))
        last = new(B, T, Ht, dtype=feature_dtype(device))
        for b, s in enumerate(samples):
            n = len(s.input_ids)
            ids[b, :n], mask[b, :n], argmax[b, :n] = s.input_ids, s.loss_mask, s.target_argmax
            aux[b, :n], last[b, :n] = s.aux, s.last
        return Batch(*(t.to(device, non_blocking=pin) for t in (ids, mask, aux, last, argmax)))

    def packed_batch(self, rows: list[list[Segment]], row_tokens: int, device: torch.device) -> Batch:
        """Rows built on the CPU from the memory-mapped shards, then moved (only the packed tokens travel)."""
        return pack_rows(rows, row_tokens, self.store.sample, device, feature_dtype(device))

    def loss_mask(self, k: int) -> torch.Tensor:
        return self.store.sample(k).loss_mask

    def target_head(self) -> torch.Tensor:
        return self._tensors["lm_head"].float()

    def embed_tokens(self) -> torch.Tensor:
        return self._tensors["embed_tokens"].float()

    def token_counts(self) -> torch.Tensor:
        return self.store.token_counts()


class OnlineSource:
    """Online features: the target runs in this process over tokenized conversations."""

    def __init__(self, conversations: Path, target: str, aux_ids: tuple[int, ...] | None, max_length: int,
                 device: torch.device, family: str = "eagle3"):
        """`family`: whose aux ids a run without --aux-ids reads (dflash: `default_dflash_aux_ids`)."""
        model_dir = resolve_target(target)
        self.target_spec = describe_target(read_config(model_dir))
        self.target_name = target
        self.identity = target_identity(model_dir, target)
        self.aux_ids = target_aux_ids(target, self.target_spec, aux_ids, family)
        require_conversations(conversations)  # a bad line is named before the target loads
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.model, self.tokenizer = load_target(model_dir, dtype=dtype, device=str(device))
        self.samples: list[TokenizedSample] = [s for _, s in tokenized_conversations(conversations, self.tokenizer, max_length)]
        require_samples(self.samples, Path(conversations), max_length)
        self.lengths = [len(s.input_ids) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def features(self, keys: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, TargetFeatures]:
        """Samples `keys` right-padded on `device`: input_ids (B, T), loss_mask (B, T) and the target's features
        (run without an attention mask: right padding needs none, `target_features`)."""
        ids, _, mask = pad_batch([self.samples[k] for k in keys], pad_id=0)
        ids, mask = ids.to(device), mask.to(device)
        return ids, mask, target_features(self.model, ids, None, self.aux_ids)

    def batch(self, indices: list[int], device: torch.device) -> Batch:
        ids, mask, feats = self.features(indices, device)
        return Batch(ids, mask, feats.aux.clone(), feats.last.clone(), feats.target_argmax.clone())

    def packed_batch(self, rows: list[list[Segment]], row_tokens: int, device: torch.device) -> Batch:
        """The target runs over the rows' samples whole (a piece of a split sample keeps its full left context,
        as in a store), then their features are packed into the rows."""
        keys = sorted({k for row in rows for k, _, _ in row})
        ids, mask, feats = self.features(keys, device)
        at = {k: j for j, k in enumerate(keys)}

        def sample(k: int) -> Sample:
            j = at[k]
            return Sample(ids[j], mask[j], feats.aux[j], feats.last[j], feats.target_argmax[j])

        return pack_rows(rows, row_tokens, sample, device, feats.aux.dtype)

    def loss_mask(self, k: int) -> torch.Tensor:
        return torch.tensor(self.samples[k].loss_mask)

    def target_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach().float()

    def embed_tokens(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach().float()

    def token_counts(self) -> torch.Tensor:
        counts = torch.zeros(self.target_spec.vocab_size, dtype=torch.int64)
        for s in self.samples:
            ids = torch.tensor(s.input_ids)
            counts += torch.bincount(ids[torch.tensor(s.loss_mask, dtype=torch.bool)], minlength=counts.numel())
        return counts
