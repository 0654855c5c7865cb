"""The draft vocabulary: the V_d target tokens the drafter can propose, and its maps `d2t` / `t2d`.

Selection (docs/training.md §6): the V_d most frequent target tokens at supervised (loss-masked)
positions of the training data, ties broken by token id, then sorted by token id.

Maps, exactly as the engines read them:
- `d2t` int64 [V_d]: offsets, target id = draft id + d2t[draft id]. vLLM scatters draft logits to
  `arange(V_d) + d2t`; SGLang builds `hot_token_id = d2t + arange`.
- `t2d` bool [V]: True for selected target tokens (written for peers; both engines ignore it).

Default size: 32,000 for target vocabularies of 64k tokens or more (the size of the EAGLE-3 release
and most public drafters), otherwise V // 6 rounded down to a multiple of 64: 8,192 for SmolLM2's
49,152, where the head is then a sixth of the target's (the head is 21 % of SmolLM2's parameters,
docs/training.md §6) while keeping almost all supervised tokens (coverage is reported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError

LARGE_VOCAB_DRAFT_SIZE = 32000
LARGE_VOCAB_THRESHOLD = 64000


def default_draft_vocab_size(vocab_size: int) -> int:
    if vocab_size >= LARGE_VOCAB_THRESHOLD:
        return LARGE_VOCAB_DRAFT_SIZE
    return max(64, (vocab_size // 6) // 64 * 64)


@dataclass(frozen=True)
class DraftVocab:
    """d2t (V_d,) int64 offsets; t2d (V,) bool; coverage = share of supervised tokens inside."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    coverage: float

    @property
    def token_ids(self) -> torch.Tensor:
        """Target ids of draft ids 0..V_d-1, ascending."""
        return torch.arange(len(self.d2t)) + self.d2t


def build_draft_vocab(counts: torch.Tensor, size: int) -> DraftVocab:
    """Pick the `size` most frequent tokens from per-token counts (V,) and build the maps."""
    size = min(size, counts.numel())
    order = torch.argsort(-frequency_rank(counts), stable=True)  # most frequent first, ties to the lower id
    selected, _ = torch.sort(order[:size])
    return selected_vocab(selected, counts)


def frequency_rank(counts: torch.Tensor) -> torch.Tensor:
    """(V,) float64: higher for a more frequent token, and for the lower id among equally frequent ones."""
    vocab_size = counts.numel()
    return counts.to(torch.float64) - torch.arange(vocab_size) / (2.0 * vocab_size)


def selected_vocab(selected: torch.Tensor, counts: torch.Tensor) -> DraftVocab:
    """The maps of the ascending target ids `selected` (V_d,), and their share of `counts` (V,)."""
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[selected] = True
    total = counts.sum().item()
    coverage = counts[selected].sum().item() / total if total else 0.0
    return DraftVocab((selected - torch.arange(len(selected))).to(torch.int64), t2d, float(coverage))


def vocab_from_maps(d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
    """Rebuild a DraftVocab from a checkpoint's d2t (t2d is derived, so both always agree)."""
    ids = torch.arange(len(d2t)) + d2t
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return DraftVocab(d2t.to(torch.int64), t2d, float("nan"))


def grow_draft_vocab(d2t: torch.Tensor, counts: torch.Tensor, size: int) -> DraftVocab:
    """A starting drafter's vocabulary (its d2t) grown to `size` tokens: every token it had, then the most
    frequent of the others in `counts` (V,) (ties to the lower id), sorted by token id as `build_draft_vocab`'s.

    Raises:
        DraftsmithError: `size` below the starting vocabulary or above the target's.
    """
    vocab_size = counts.numel()
    old = torch.arange(len(d2t)) + d2t.to(torch.int64)
    if not len(old) <= size <= vocab_size:
        raise DraftsmithError("cannot grow the draft vocabulary to that size", got=f"{size} tokens",
                              expected=f"between the starting drafter's {len(old)} and the target's {vocab_size}",
                              fix="pass a --draft-vocab-size in that range, or leave it out to keep the starting one")
    rank = frequency_rank(counts)
    rank[old] = float("inf")  # the starting tokens stay, whatever this data's counts
    selected, _ = torch.sort(torch.topk(rank, size).indices)
    return selected_vocab(selected, counts)
