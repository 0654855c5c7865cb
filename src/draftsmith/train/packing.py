"""The data order, pure functions of (seed, epoch): the held-back split, micro-batches, and packing.

Unpacked, an epoch is a seeded shuffle of the training samples grouped into micro-batches of about
--batch-tokens (`micro_batches`). Packed (the default), it is a seeded shuffle of the documents (whole samples,
or pieces of longer ones ending at assistant-turn ends: `document_pieces`), placed best-fit into rows of
--row-tokens (`pack_plan`), a fixed number of rows per micro-batch (`packed_shape`). Nothing here holds state:
a checkpoint needs only the step to find its place in the data again.

    plan = epoch_plan(split.documents(train=True, packed=True), lengths, 4096, (4096, 1), seed=0, epoch=0)
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftsmith.capture.local import group_by_tokens
from draftsmith.train.features import Segment
from draftsmith.train.settings import TrainConfig

EVAL_SPLIT_SEED = 1234  # fixed: the held-back samples do not move when --seed changes


def split_indices(n: int, eval_fraction: float) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices; eval is a fixed random share, at least one sample when n > 1."""
    g = torch.Generator().manual_seed(EVAL_SPLIT_SEED)
    perm = torch.randperm(n, generator=g).tolist()
    n_eval = min(n - 1, max(1, round(eval_fraction * n))) if eval_fraction > 0 and n > 1 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def micro_batches(indices: list[int], lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches: a seeded shuffle, length-sorted in windows of 64 to cut padding."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    window = 64
    order = [k for w in range(0, len(order), window) for k in sorted(order[w:w + window], key=lambda k: lengths[k])]
    return [[order[i] for i in group] for group in group_by_tokens([lengths[k] for k in order], batch_tokens)]


@dataclass
class Split:
    """The run's samples: training and held-back indices and, packed, the documents packing places from each
    (following a store, all four grow as its shards land)."""

    train_idx: list[int] = field(default_factory=list)
    eval_idx: list[int] = field(default_factory=list)
    train_pieces: list[Segment] = field(default_factory=list)
    eval_pieces: list[Segment] = field(default_factory=list)

    def documents(self, train: bool, packed: bool) -> list:
        """What an epoch plan orders: packed, the pieces; unpacked, the sample indices."""
        if packed:
            return self.train_pieces if train else self.eval_pieces
        return self.train_idx if train else self.eval_idx


def split_samples(train_idx: list[int], eval_idx: list[int], lengths: list[int], row_tokens: int | None, long: str,
                  loss_mask: Callable[[int], torch.Tensor]) -> Split:
    """The split of these samples; packed (`row_tokens` set), with the documents packing places from each."""
    if row_tokens is None:
        return Split(train_idx, eval_idx)
    return Split(train_idx, eval_idx, *(document_pieces(idx, lengths, row_tokens, long, loss_mask)
                                        for idx in (train_idx, eval_idx)))


PACK_WINDOW = 512
"""Packing fills rows best-fit, longest first, within windows of this many shuffled pieces: rows ~full, and
the data order stays a shuffle."""


def turn_pieces(loss_mask: torch.Tensor, row_tokens: int) -> list[tuple[int, int]]:
    """Split a sample into [start, end) pieces of at most row_tokens, each ending where an assistant turn
    ends (a supervised token followed by an unsupervised one, or the sample's end) when one fits, else
    at the row length. Pieces without a supervised token are dropped."""
    m = loss_mask.bool()
    n = len(m)
    ends = set((torch.nonzero(m[:-1] & ~m[1:]).flatten() + 1).tolist()) | {n}
    pieces, start = [], 0
    while start < n:
        fits = [e for e in ends if start < e <= start + row_tokens]
        end = max(fits) if fits else min(n, start + row_tokens)
        if m[start:end].any():
            pieces.append((start, end))
        start = end
    return pieces


def document_pieces(indices: list[int], lengths: list[int], row_tokens: int, long: str,
                    loss_mask: Callable[[int], torch.Tensor]) -> list[Segment]:
    """The documents packing places: each sample whole, or, when longer than a row, split or truncated."""
    pieces = []
    for k in indices:
        if lengths[k] <= row_tokens:
            pieces.append((k, 0, lengths[k]))
        elif long == "truncate":
            pieces.append((k, 0, row_tokens))
        else:
            pieces += [(k, a, b) for a, b in turn_pieces(loss_mask(k), row_tokens)]
    return pieces


def best_fit_rows(pieces: list[Segment], row_tokens: int) -> list[list[Segment]]:
    """Rows of at most row_tokens, each piece into the fullest row that still has room for it."""
    rows: list[list[Segment]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for piece in pieces:
        n = piece[2] - piece[1]
        i = bisect.bisect_left(free, (n, -1))
        if i == len(free):
            rows.append([piece])
            bisect.insort(free, (row_tokens - n, len(rows) - 1))
        else:
            room, r = free.pop(i)
            rows[r].append(piece)
            bisect.insort(free, (room - n, r))
    return rows


def pack_plan(pieces: list[Segment], row_tokens: int, rows_per_batch: int, seed: int,
              epoch: int) -> list[list[list[Segment]]]:
    """The epoch's packed micro-batches, each exactly rows_per_batch rows (the last filled up with empty rows):
    a seeded shuffle of the pieces, packed best-fit, longest first, within windows of `PACK_WINDOW`, then the
    rows shuffled. Best-fit longest-first fills a window's first rows with its longest documents and its last
    rows with its shortest: unshuffled, consecutive steps would cycle from long to short documents every
    window (the loss swung between about 5 and 9 in the embedded drafter's session-10 build)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = [pieces[i] for i in torch.randperm(len(pieces), generator=g).tolist()]
    rows = []
    for w in range(0, len(order), PACK_WINDOW):
        window = sorted(order[w:w + PACK_WINDOW], key=lambda p: p[2] - p[1], reverse=True)
        rows += best_fit_rows(window, row_tokens)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    plan = [rows[i:i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]
    if plan:
        plan[-1] += [[] for _ in range(rows_per_batch - len(plan[-1]))]
    return plan


def epoch_plan(documents: list, lengths: list[int], batch_tokens: int, shape: tuple[int, int] | None, seed: int,
               epoch: int) -> list:
    """An epoch's micro-batches: with a packed `shape` (row tokens, rows per micro-batch), `pack_plan`'s rows of
    segments; unpacked (None), `micro_batches`' lists of sample indices."""
    if shape is None:
        return micro_batches(documents, lengths, batch_tokens, seed, epoch)
    return pack_plan(documents, *shape, seed, epoch)


def packed_shape(lengths: list[int], train_idx: list[int], cfg: TrainConfig) -> tuple[int, int]:
    """(row tokens, rows per micro-batch): the one micro-batch shape of a packed run, fixed at its start.

    batch_tokens // row_tokens rows of row_tokens (default batch_tokens), except that a training set smaller
    than one micro-batch does not pay for padding it can never fill: the rows shrink to its size (rounded up
    to 64 tokens) and their number to what it fills.
    """
    row = cfg.row_tokens or cfg.batch_tokens
    rows = cfg.batch_tokens // row
    total = sum(lengths[k] for k in train_idx)
    if cfg.row_tokens is None and total < row:
        return max(64, -(-total // 64) * 64), 1
    return row, max(1, min(rows, -(-total // row)))


def rank_micro_batches(plan: list[list[int]], offset: int, world: int, grad_accum: int, rank: int) -> list[list[int]]:
    """Rank `rank`'s `grad_accum` micro-batches of the epoch's step `offset`.

    The number of steps per epoch is fixed from epoch 0's plan, but another epoch's shuffle can pack into
    fewer micro-batches; its last steps then wrap around to the epoch's start, so every step of every rank
    gets exactly `grad_accum` micro-batches (an empty step would crash, and uneven ranks would hang DDP).
    """
    per_step = world * grad_accum
    mine = [plan[(offset * per_step + j) % len(plan)] for j in range(per_step)]
    return mine[rank * grad_accum: (rank + 1) * grad_accum]

