"""`draftsmith train`: train an EAGLE-3 drafter with training-time test, offline or online.

- offline: features come from a feature store (`draftsmith capture`);
- online: the target runs in the training process over a conversations file (no store).

One explicit loop: periodic eval / checkpoint -> micro-batch forward / backward -> clip -> step -> log.
The learning rate is a pure function of the step (`lr_at`), the data order a pure function of
(seed, epoch), so a checkpoint needs only the weights, the optimizer and the step to resume exactly.
Micro-batches are packed by default (`pack_plan`): rows of a fixed length holding whole conversations
with document masks, so every step has the same tensor shape (a compiled step never recompiles) and
little padding; `--no-pack` pads one conversation per row instead.
Runs unchanged under `torchrun --nproc-per-node N` (DDP; gloo on CPU, NCCL on GPU): the loss is
normalised by the supervised-token count of the whole global batch, so N processes with the same global
batch compute the same update as one process with gradient accumulation.

Run: draftsmith train --store runs/demo/store --out runs/demo/train --epochs 2

`--follow` trains on a store while a capture still writes it: epoch 0 is the landed shards' plans one after
the other (each shard shuffled and packed on its own, from the lengths its manifest entry lists), it ends
when the writer marks the store complete, and later epochs are the usual whole-store shuffles.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import gc
import json
import math
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from pydantic import model_validator

from draftsmith.capture.local import group_by_tokens
from draftsmith.config import Settings, add_flags, from_flags
from draftsmith.model.checkpoint import drafter_path, load_drafter, save_drafter
from draftsmith.model.eagle3 import (NORM_VARIANTS, TTT_STEP_LOSS_DECAY, TTT_STEPS, DrafterConfig, Eagle3Drafter, TTTOutput, compile_for_training,
                               engine_walk_acceptance, simulated_acceptance, with_draft_vocab)
from draftsmith.errors import DraftsmithError
from draftsmith.train.features import Batch, FeatureSource, OnlineSource, Segment, StoreSource, feature_dtype
from draftsmith.train.shards import sane_shard, wait_published
from draftsmith.target import pick_device
from draftsmith.model.vocab import build_draft_vocab, default_draft_vocab_size, grow_draft_vocab

SCRATCH_LR = 1e-3
"""Default peak lr of a new drafter (TrainSettings.lr)."""
FINE_TUNE_LR = 2e-4
"""Default peak lr with --init-from: the shipped-drafter fine-tunes of `run` and the embedded builds use it."""
EVAL_SPLIT_SEED = 1234  # fixed: the held-back samples do not move when --seed changes


class Layout(NamedTuple):
    """A drafter's norm variants and head as trained (TrainSettings.layout)."""

    norm_before_fc: bool
    norm_output: bool
    norm_before_residual: bool
    head_init: str  # random, target, or init (the starting drafter's head)
    train_head: bool


RECIPES = {"normed": Layout(True, False, True, "target", False), "plain": Layout(False, False, False, "random", True)}
"""The two layouts --recipe names: normed (speculators' defaults less norm_output, which added nothing measurable
and which llama.cpp does not compute: docs/peers.md, "Which part of the normed recipe"); plain (EAGLE-3 /
SpecForge's)."""
DEFAULT_RECIPE = "normed"
"""--recipe auto for the train verb (`run` resolves auto by its export formats: recipe_for)."""


def recipe_for(recipe: str, formats: tuple[str, ...]) -> str:
    """--recipe as `run` trains a new drafter: auto becomes plain when a format's engine does not compute the
    normed recipe's norms (what export refuses), else normed; an explicit recipe stays."""
    from draftsmith.conventions import unread_norms

    if recipe != "auto":
        return recipe
    normed = RECIPES[DEFAULT_RECIPE]._asdict()
    return "plain" if any(unread_norms(normed, f) for f in formats) else DEFAULT_RECIPE


class TrainSettings(Settings):
    """How a drafter is trained, whatever the data: the `train` verb's flags and `run`'s train section."""

    draft_vocab_size: int | None = None
    """Draft vocabulary size (default: vocab.default_draft_vocab_size). With init_from, a size above the starting
    drafter's grows its vocabulary (its tokens, then this data's most frequent others; a new token's head row
    starts as the target's); a smaller one or none keeps the starting drafter's."""
    ttt_steps: int = TTT_STEPS
    """Training-time-test unroll length (EAGLE-3 / SpecForge: 7)."""
    step_loss_decay: float = TTT_STEP_LOSS_DECAY
    """Weight of TTT step i is decay**i (EAGLE-3: 0.8)."""
    lr: float | None = None
    """Peak learning rate of the cosine schedule; default 1e-3 for a new drafter, 2e-4 with --init-from
    (fine-tuning a trained one). On one H200 epoch of 3 M SmolLM2 tokens, 1e-3 drafted tau 1.67 at k=4 against
    1.36 at SpecForge's 1e-4 (2e-3: 1.65; docs/peers.md, "speculators' defaults against draftsmith's"); long
    runs on large data may prefer 1e-4."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.015
    """Share of steps with linear warm-up (SpecForge 0.015)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip: float = 0.5
    """Gradient-norm clip (EAGLE, SpecForge)."""
    epochs: float = 1.0
    """Passes over the training split (fractions allowed)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs)."""
    batch_tokens: int = 4096
    """Tokens per micro-batch, padding included (packed: batch_tokens // row_tokens rows)."""
    pack: bool = True
    """Pack whole conversations into rows of --row-tokens with document masks (positions restart per
    conversation, attention stays inside it): one tensor shape for the whole run, so a compiled step never
    recompiles, and little padding. --no-pack: one conversation per row, padded to the micro-batch's longest."""
    row_tokens: int | None = None
    """Packed row length (default: batch_tokens)."""
    pack_long: str = "split"
    """Packing, conversations longer than a row: split (into pieces ending at assistant-turn ends, or at the row
    length where a turn is longer) or truncate (keep the first row)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step and process."""
    eval_fraction: float = 0.05
    """Share of samples held back for evaluation (fixed split)."""
    eval_every: int = 100
    """Evaluate every N steps (and at the end)."""
    save_every: int = 100
    """Checkpoint every N steps (and at the end)."""
    log_every: int = 1
    """Print the step line every N steps (metrics.jsonl gets every step)."""
    seed: int = 0
    """Seed of the initialisation and the data order."""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda, cuda:1, ..."""
    init_from: str | None = None
    """Start from an existing draftsmith drafter checkpoint, or a shipped one by short name (smollm2); `run` also
    takes auto (the drafter shipped for its target, when there is one and the engines of export.formats compute
    its norms: the smollm2 drafter is normed, so a run that exports for sglang trains from scratch)."""
    recipe: str = "auto"
    """The layout of a new drafter (ignored with --init-from, whose drafter keeps its own): normed (an RMSNorm
    over the aux states before fc, the normed state as the residual, and the draft head started as the target's
    own head rows and frozen: speculators' layout less its normed output state), plain (EAGLE-3 / SpecForge's:
    none of these, a random head that trains) or auto (normed; `run` takes plain when export.formats names
    sglang, whose released engines do not compute those norms). vLLM and llama.cpp serve both. On one H200
    epoch of 3 M SmolLM2 tokens, normed drafted tau 1.91 at k=4 on unseen chat prompts, speculators' own
    defaults 1.80 in the same session, plain 1.68 (docs/peers.md, "The ablations"). The five fields below
    override one part of the recipe each."""
    head_init: str | None = None
    """The draft head of a new drafter: random (nn.Linear's default) or target (the target's own lm_head rows
    for the draft vocabulary, as speculators initialises it); null: the recipe's (normed: target, plain:
    random). Ignored with --init-from."""
    train_head: bool | None = None
    """Train the draft head; --no-train-head keeps it frozen at its initial value (speculators' way); null: the
    recipe's (normed: frozen, plain: trained; with --init-from: trained)."""
    norm_before_fc: bool | None = None
    """A new drafter gets an RMSNorm over the concatenated aux states before fc (vLLM and llama.cpp serve it,
    SGLang before 0.5.17 does not: export refuses); null: the recipe's (normed: true). Ignored with --init-from
    (the drafter keeps its own)."""
    norm_output: bool | None = None
    """A new drafter feeds its normed output state to the next draft step (vLLM serves it, SGLang and
    llama.cpp do not); null: the recipe's (false in both: speculators sets it, and on one H200 epoch it moved
    neither simulated nor decoded tau). Ignored with --init-from."""
    norm_before_residual: bool | None = None
    """A new drafter's residual is the normed hidden state (vLLM and llama.cpp serve it, SGLang computes False);
    null: the recipe's (normed: true). Ignored with --init-from."""
    keep_start: bool = True
    """With --init-from: measure the starting drafter on the held-back samples before the first step, and write it
    unchanged as the result when fine-tuning did not raise held-back simulated tau at k = --ttt-steps (a short
    fine-tune on little data can lower it). --no-keep-start always writes the fine-tuned drafter. Not with --follow
    (the held-back set grows while the store lands)."""
    compile: bool = False
    """torch.compile the drafter's whole training forward, from the target's softmax and the masks through the TTT
    steps to the loss, as one region (`compile_for_training`; unpacked lengths recompile once, then run with
    dynamic shapes). Measured before the region grew to the whole forward: for long GPU
    runs: on one H200 at SmolLM2's size its 33-96 s of compile paid back after about 1,000 steps with 8192-token
    rows and TTT 3, and about 12,000 steps (49 M tokens) at the defaults (docs/gpu.md, "A small drafter's step")."""
    cuda_graphs: bool = False
    """With --compile on CUDA: the compiled training forward and its backward replay as CUDA graphs (torch.compile's
    reduce-overhead mode), one launch each instead of one per kernel, for small drafters whose step is
    launch-bound. Needs one tensor shape per run (--pack, the default) and --grad-accum 1."""
    parallel: str = "ddp"
    """Under torchrun: ddp (each rank holds the whole drafter) or fsdp (FSDP2 `fully_shard`: weights,
    gradients and AdamW state sharded across ranks, for drafters whose training state does not fit one device)."""

    @model_validator(mode="after")
    def check_settings(self) -> TrainSettings:
        if self.ttt_steps < 1 or not 0 < self.step_loss_decay <= 1:
            raise DraftsmithError("bad TTT settings", got=f"--ttt-steps {self.ttt_steps}, --step-loss-decay "
                                  f"{self.step_loss_decay}", expected="steps >= 1, 0 < decay <= 1", fix="fix the flags")
        row = self.row_tokens or self.batch_tokens
        if self.pack and not (1 <= row <= self.batch_tokens and self.pack_long in ("split", "truncate")):
            raise DraftsmithError("bad packing settings", got=f"--row-tokens {self.row_tokens}, --batch-tokens "
                                  f"{self.batch_tokens}, --pack-long {self.pack_long}",
                                  expected="1 <= row tokens <= batch tokens; --pack-long split or truncate",
                                  fix="fix the flags (or pass --no-pack)")
        if self.head_init not in (None, "target", "random"):
            raise DraftsmithError("unknown --head-init", got=self.head_init, expected="target or random",
                                  fix="pass --head-init random or --head-init target (or leave it to --recipe)")
        if self.recipe not in RECIPES and self.recipe != "auto":
            raise DraftsmithError("unknown --recipe", got=self.recipe, expected=f"auto, {', '.join(RECIPES)}",
                                  fix="pass --recipe auto (default), normed or plain")
        if self.lr is not None and not self.lr > 0:
            raise DraftsmithError("bad --lr", got=str(self.lr), expected="a peak learning rate > 0",
                                  fix="pass e.g. --lr 1e-3, or leave it out for the default")
        if self.cuda_graphs and not (self.compile and self.pack):
            raise DraftsmithError("--cuda-graphs replays the compiled step at one shape", got=f"--cuda-graphs with "
                                  f"--{'' if self.compile else 'no-'}compile, --{'' if self.pack else 'no-'}pack",
                                  expected="--compile and --pack (the default) with it",
                                  fix="add --compile (and leave --pack on), or drop --cuda-graphs")
        if self.cuda_graphs and self.grad_accum > 1:
            # measured on an H200 (tests/test_gpu.py): the second micro-batch's replay writes into the memory that
            # holds the first one's gradients ("accessing tensor output of CUDAGraphs that has been overwritten")
            raise DraftsmithError("--cuda-graphs accumulates no gradients across micro-batches",
                                  got=f"--cuda-graphs with --grad-accum {self.grad_accum}",
                                  expected="--grad-accum 1 with --cuda-graphs",
                                  fix=f"raise --batch-tokens {self.grad_accum}x instead (one micro-batch per step), "
                                      "or drop --cuda-graphs")
        if self.parallel not in ("ddp", "fsdp"):
            raise DraftsmithError("unknown --parallel", got=self.parallel, expected="ddp or fsdp",
                                  fix="pass --parallel ddp (default) or --parallel fsdp")
        return self

    def layout(self, start: DrafterConfig | None = None) -> Layout:
        """The drafter's norms and head as this run trains them: the recipe's, each field set overriding it;
        with a starting drafter (`start`, --init-from) its own norms and a trained head unless told."""
        if start is not None:
            return Layout(**{f: getattr(start, f) for f in NORM_VARIANTS}, head_init="init",
                          train_head=True if self.train_head is None else self.train_head)
        recipe = RECIPES[DEFAULT_RECIPE if self.recipe == "auto" else self.recipe]
        return Layout(**{f: getattr(recipe, f) if getattr(self, f) is None else getattr(self, f)
                         for f in Layout._fields})

    @property
    def peak_lr(self) -> float:
        """lr, or its default: FINE_TUNE_LR with init_from, else SCRATCH_LR."""
        if self.lr is not None:
            return self.lr
        return FINE_TUNE_LR if self.init_from else SCRATCH_LR


class TrainConfig(TrainSettings):
    """Everything that defines a training run (saved as train_config.json in the output directory)."""

    out: str
    """Output directory: checkpoints, metrics.jsonl, the final drafter."""
    store: str | None = None
    """Feature store directory (offline training)."""
    conversations: str | None = None
    """Conversations JSONL (online training: the target runs in this process)."""
    target: str = "smollm2"
    """Target for online training (and its identity check)."""
    aux_ids: tuple[int, ...] | None = None
    """Online only: boundary aux ids (default 2, N//2, N-3). Offline runs use the store's."""
    max_length: int = 2048
    """Online only: truncate conversations to this many tokens."""

    follow: bool = False
    """Train on a store that is still being written (a capture running into --store): epoch 0 takes each shard
    as it lands, in landing order, shuffled and packed within the shard, and ends when the writer marks the
    store complete; later epochs shuffle over every sample. The eval split is made per shard. Needs --max-steps
    (the store's size is not known at the start)."""
    follow_timeout_s: float = 3600.0
    """--follow: give up when the store has not grown for this long."""
    delete_consumed: bool = False
    """--follow: delete each shard from the store once every step that reads it is checkpointed, so that the
    store holds only the writer's lead and about --save-every steps of shards (a TB-scale capture through
    bounded disk). Its held-back samples are copied to OUT/consumed/ first (evaluation reads them), with the
    shard's plan (a resume rebuilds epoch 0 from it). One pass: each shard is read once, so training ends
    with epoch 0 even when --max-steps is larger (the learning-rate schedule still spans --max-steps)."""

    @model_validator(mode="after")
    def check_source(self) -> TrainConfig:
        if (self.store is None) == (self.conversations is None):
            raise DraftsmithError("train needs exactly one data source", got=f"store={self.store}, "
                                  f"conversations={self.conversations}", expected="--store DIR or --conversations FILE",
                                  fix="pass --store for offline training or --conversations for online training")
        if self.follow and (self.store is None or self.max_steps is None):
            raise DraftsmithError("--follow needs --store and --max-steps", got=f"store={self.store}, "
                                  f"max_steps={self.max_steps}", expected="the store being captured, and a step budget "
                                  "(its size is unknown when training starts)", fix="add --store DIR --max-steps N")
        if self.delete_consumed and not (self.follow and self.epochs == 1.0):
            raise DraftsmithError("--delete-consumed reads each shard once, while the store is written",
                                  got=f"follow={self.follow}, epochs={self.epochs}",
                                  expected="--follow, and one epoch (a deleted shard cannot be read again)",
                                  fix="add --follow and drop --epochs, or train without --delete-consumed")
        return self


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak lr, then cosine down to it times min_lr_ratio."""
    warmup = max(1, int(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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


FOLLOW_SHARD_EPOCH = 1_000_000
"""--follow: shard i of epoch 0 is shuffled as `epoch` FOLLOW_SHARD_EPOCH + i of the seeded plans, apart from
the whole-store epochs 1, 2, ..."""


CONSUMED = "consumed"
"""--delete-consumed: OUT/consumed/shard-NNNNN.json (a deleted shard's plan) and .safetensors (its held-back samples)."""


@dataclass(frozen=True)
class ShardPlan:
    """--follow: one landed shard's share of the run, a pure function of its samples and the plan settings."""

    train: list[int]
    """Global indices of its training samples."""
    held: list[int]
    """Global indices of its held-back (eval) samples."""
    micro_batches: list
    """Its epoch-0 micro-batches (packed: rows of segments; unpacked: sample indices)."""
    train_pieces: list[Segment]
    eval_pieces: list[Segment]

    @classmethod
    def from_json(cls, d: dict, packed: bool) -> ShardPlan:
        def segs(rows):  # JSON made the (sample, start, end) tuples lists
            return [tuple(x) for x in rows]
        mbs = [[segs(row) for row in mb] for mb in d["micro_batches"]] if packed else d["micro_batches"]
        return cls(d["train"], d["held"], mbs, segs(d["train_pieces"]), segs(d["eval_pieces"]))


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


@dataclass(frozen=True)
class EvalResult:
    acc: list[float]
    """Per TTT step: share of supervised positions where the drafter's argmax is the target's."""
    tau: dict[int, float]
    """Simulated mean acceptance length (bonus token included) of k-token greedy chains placed as an engine places
    them, each after the last one ended (`engine_walk_acceptance`): what decoding these samples would measure."""
    loss: float
    tau_all_starts: dict[int, float] = field(default_factory=dict)
    """The same with a chain at every supervised index (`simulated_acceptance`): higher than decoded tau for k > 1."""


def read_start_eval(metrics: Path) -> EvalResult | None:
    """The starting drafter's held-back result a run logged before its first step (None if it logged none)."""
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        rec = json.loads(line)
        if rec.get("starting_drafter"):
            e = rec["eval"]  # JSON made the k keys strings
            return EvalResult(acc=e["acc"], tau={int(k): v for k, v in e["tau"].items()}, loss=e["loss"],
                              tau_all_starts={int(k): v for k, v in e["tau_all_starts"].items()})
    return None


def selection(kept: str, start: EvalResult, fine_tuned: EvalResult, k: int) -> dict:
    """Which drafter a fine-tune wrote and the held-back simulated tau that chose it (in the drafter's config)."""
    return {"kept": kept, "k": k, "starting_tau": start.tau[k], "fine_tuned_tau": fine_tuned.tau[k]}


def rank_micro_batches(plan: list[list[int]], offset: int, world: int, grad_accum: int, rank: int) -> list[list[int]]:
    """Rank `rank`'s `grad_accum` micro-batches of the epoch's step `offset`.

    The number of steps per epoch is fixed from epoch 0's plan, but another epoch's shuffle can pack into
    fewer micro-batches; its last steps then wrap around to the epoch's start, so every step of every rank
    gets exactly `grad_accum` micro-batches (an empty step would crash, and uneven ranks would hang DDP).
    """
    per_step = world * grad_accum
    mine = [plan[(offset * per_step + j) % len(plan)] for j in range(per_step)]
    return mine[rank * grad_accum: (rank + 1) * grad_accum]


@dataclass
class PendingStep:
    """A step queued on the device (`Trainer.launch_step`): its statistics stay there until `resolve` reads them
    (the one CPU-GPU sync of a step)."""

    step: int
    ttt_steps: int
    lr: float
    t0: float
    stats: torch.Tensor  # [loss, loss_sum (K), correct (K), count (K), real, supervised, grad_norm], summed over ranks
    tokens: int
    shape: list[int]

    def resolve(self, end: float | None = None) -> dict:
        """Wait for the step and return its record (the row metrics.jsonl gets and the step line prints). Its time
        runs from its launch to `end`: the next step's launch when the loop queued that one first (so a step's
        time is the loop's period, on a GPU, where launches run ahead, as on the CPU, where a launch does the
        work), else now."""
        stats = self.stats.tolist()  # CPU-GPU sync point: once per step, one step behind the launches
        dt = (end or time.perf_counter()) - self.t0
        K = self.ttt_steps
        counts = stats[2 * K + 1:3 * K + 1]
        return {"step": self.step, "loss": stats[0], "loss_per_step": [s / max(c, 1) for s, c in zip(stats[1:K + 1], counts)],
                "acc": [a / max(c, 1) for a, c in zip(stats[K + 1:2 * K + 1], counts)], "lr": self.lr,
                "grad_norm": stats[-1], "ms": dt * 1000, "tokens": self.tokens, "tok_per_s": self.tokens / dt,
                "real_tokens": int(stats[-3]), "supervised_tokens": int(stats[-2]), "real_tok_per_s": stats[-3] / dt,
                "shape": self.shape}


class Trainer:
    """Holds the run's state; `run()` is the loop."""

    def __init__(self, cfg: TrainConfig, data: FeatureSource | None = None):
        """`data` replaces the source named by cfg (benchmarks feed synthetic features of real shapes)."""
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.plan_cache: tuple[tuple | None, list] = (None, [])  # `plan`: the last epoch plan computed
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = pick_device(cfg.device)
        if self.world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                self.device = torch.device("cuda", torch.cuda.current_device())
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.autocast = self.device.type == "cuda"  # bf16 autocast, fp32 master weights
        if cfg.follow and data is None:
            wait_published(Path(cfg.store), cfg.follow_timeout_s)
        self.data: FeatureSource = data or (StoreSource(Path(cfg.store), cfg.follow) if cfg.store else
                                            OnlineSource(Path(cfg.conversations), cfg.target, cfg.aux_ids, cfg.max_length,
                                                         self.device))
        if cfg.follow:
            self.start_following()
        else:
            self.train_idx, self.eval_idx = split_indices(len(self.data), cfg.eval_fraction)
            if not self.train_idx:
                raise DraftsmithError("nothing to train on", got=f"{len(self.data)} samples with supervised tokens",
                                      expected="at least 2 (one is held back for evaluation)",
                                      fix="regenerate more conversations (or check that they have assistant turns)")
            if cfg.pack:
                self.row_tokens, self.rows_per_batch = packed_shape(self.data.lengths, self.train_idx, cfg)
                self.train_pieces, self.eval_pieces = (
                    document_pieces(idx, self.data.lengths, self.row_tokens, cfg.pack_long, self.data.loss_mask)
                    for idx in (self.train_idx, self.eval_idx))
        # The most rows (B x T) a micro-batch has: the head groups the TTT steps of every micro-batch for it, so a
        # compiled unpacked run does not recompile per grouping (`ttt_forward`'s head_rows). A followed store's
        # unpacked samples are not all known yet: the head then groups per batch.
        self.head_rows = (self.rows_per_batch * self.row_tokens if cfg.pack else
                          None if cfg.follow else max([cfg.batch_tokens, *self.data.lengths]))
        self.drafter = self.build_drafter().to(self.device)
        self.drafter.lm_head.weight.requires_grad_(self.layout.train_head)
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        if not self.fsdp:  # the frozen embedding is a lookup: in the features' dtype (FSDP2 wants one dtype)
            self.drafter.embed_tokens.to(feature_dtype(self.device))
        # In the features' dtype (bf16 on GPU: ttt_forward computes in it anyway; half the memory of fp32).
        self.target_head = self.data.target_head().to(self.device, feature_dtype(self.device))
        if cfg.compile:
            compile_for_training(self.drafter, cuda_graphs=cfg.cuda_graphs)
            if cfg.cuda_graphs:  # the same tensor every step: a replay reads it in place instead of copying it in
                torch._dynamo.mark_static_address(self.target_head)
        self.model = self.drafter
        if self.fsdp:  # shards the drafter's parameters in place; the optimizer then holds only this rank's shard
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.drafter)
        elif self.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.drafter, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda")
        per_step = self.world * cfg.grad_accum
        if not cfg.follow:  # following: set once the store is complete (`land`)
            self.steps_per_epoch = max(1, len(self.plan(train=True, epoch=0)) // per_step)
        self.total_steps = cfg.max_steps or max(1, int(cfg.epochs * self.steps_per_epoch))
        """The learning-rate schedule's length (`stop_step` is where the loop ends)."""
        self.step = self.saved_at = 0
        self.first_step_done = False  # the first step of this process compiles / warms up: logged apart
        self.loader: ThreadPoolExecutor | None = None  # `step_batches`: loads the next step's micro-batches
        self.prefetched: dict[int, Future] = {}
        self.copy_stream: torch.cuda.Stream | None = None

    @property
    def stop_step(self) -> int | float:
        """Where the loop ends: total_steps, or with --delete-consumed the end of epoch 0 when that comes first
        (infinite until the store is complete; the schedule still spans total_steps, so when the writer
        finishes changes no step's learning rate)."""
        return min(self.total_steps, self.epoch0_steps) if self.cfg.delete_consumed else self.total_steps

    def starting_drafter(self, announce: bool = False) -> Eagle3Drafter:
        """The --init-from drafter as this run starts it: loaded, checked against the target, and grown to
        --draft-vocab-size when that is larger than its own vocabulary (`vocab.grow_draft_vocab`)."""
        spec = self.data.target_spec
        drafter = load_drafter(drafter_path(self.cfg.init_from), self.data.embed_tokens())
        if drafter.config.vocab_size != spec.vocab_size or drafter.config.target_hidden_size != spec.hidden_size:
            raise DraftsmithError("--init-from drafter does not fit this target",
                                  got=f"vocab {drafter.config.vocab_size}, target hidden "
                                  f"{drafter.config.target_hidden_size}",
                                  expected=f"vocab {spec.vocab_size}, target hidden {spec.hidden_size}",
                                  fix="initialise from a drafter trained for this target")
        size = self.cfg.draft_vocab_size
        if size is None or size <= drafter.config.draft_vocab_size:  # smaller or none: the start's vocabulary
            return drafter
        counts = self.data.token_counts()
        vocab = grow_draft_vocab(drafter.d2t, counts, size)
        if announce and self.rank == 0:
            before = counts[drafter.t2d].sum().item() / max(counts.sum().item(), 1)
            print(f"draft vocabulary grown from the starting drafter's {drafter.config.draft_vocab_size} to {size} "
                  f"tokens: coverage of this data's supervised tokens {before:.4f} -> {vocab.coverage:.4f}", flush=True)
        return with_draft_vocab(drafter, vocab.d2t, vocab.t2d, self.data.target_head())

    def build_drafter(self) -> Eagle3Drafter:
        spec = self.data.target_spec
        if self.cfg.init_from:
            drafter = self.starting_drafter(announce=True)
            self.layout = self.cfg.layout(drafter.config)
            return drafter
        self.layout = self.cfg.layout()
        size = self.cfg.draft_vocab_size or default_draft_vocab_size(spec.vocab_size)
        vocab = build_draft_vocab(self.data.token_counts(), size)
        torch.manual_seed(self.cfg.seed)
        norms = {f: getattr(self.layout, f) for f in NORM_VARIANTS}
        drafter = Eagle3Drafter(replace(DrafterConfig.from_target(spec, size, self.data.aux_ids), **norms))
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(self.data.embed_tokens())
            drafter.d2t.copy_(vocab.d2t)
            drafter.t2d.copy_(vocab.t2d)
            if self.layout.head_init == "target":  # (V_d, H): the target's head rows, in draft-id order
                drafter.lm_head.weight.copy_(self.data.target_head()[vocab.token_ids])
        if self.rank == 0:
            print(f"draft vocabulary: the {size} most frequent of this data's supervised tokens, coverage "
                  f"{vocab.coverage:.4f}", flush=True)
        return drafter

    # -- one optimizer step ---------------------------------------------------------------------------

    def forward(self, batch: Batch, denominators: torch.Tensor | None) -> TTTOutput:
        if self.cfg.cuda_graphs:  # the graphs' outputs of the last forward are consumed: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model(batch.aux, batch.input_ids, batch.loss_mask, batch.last, self.target_head,
                              self.cfg.ttt_steps, self.cfg.step_loss_decay, denominators, batch.target_argmax,
                              batch.documents, self.head_rows)

    def plan(self, train: bool, epoch: int) -> list:
        """An epoch's micro-batches (a pure function of seed and epoch): packed, lists of rows of segments;
        unpacked, lists of sample indices. The eval plan is fixed (seed 0, epoch 0). The last one computed is
        kept (a step asks for its epoch's plan, which took 5 ms over 7,000 conversations and 38 ms over 46,000
        on the 2-core CPU); a following run's plan changes as shards land, so the key holds the sample count."""
        seed = self.cfg.seed if train else 0
        pieces = (self.train_pieces if train else self.eval_pieces) if self.cfg.pack else \
            (self.train_idx if train else self.eval_idx)
        key = (train, epoch, len(pieces))
        if self.plan_cache[0] != key:
            plan = (pack_plan(pieces, self.row_tokens, self.rows_per_batch, seed, epoch) if self.cfg.pack else
                    micro_batches(pieces, self.data.lengths, self.cfg.batch_tokens, seed, epoch))
            self.plan_cache = (key, plan)
        return self.plan_cache[1]

    def step_batches(self, step: int) -> tuple[list, list[Batch]]:
        """Global step `step`'s micro-batches of this rank, planned and loaded. The next step's are loaded on a
        background thread meanwhile, so that reading, packing and copying them overlaps this step on the device
        (a store's memory-mapped shards, or the online target's forward). Not with --follow, whose next plan may
        wait on the store."""
        future = self.prefetched.pop(step, None)
        if future is None:
            plan = self.micro_batches_for(step)
            batches = [self.load(mb) for mb in plan]
        else:
            plan, batches, copied = future.result()
            if copied is not None:  # loaded on the copy stream: this stream waits for it, and owns the tensors
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(copied)
                for t in (t for b in batches for t in vars(b).values() if t is not None):
                    t.record_stream(stream)
        if not self.cfg.follow and step + 1 < self.stop_step:
            if self.loader is None:
                self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftsmith-prefetch")
                self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            self.prefetched = {step + 1: self.loader.submit(self.load_step, step + 1)}
        return plan, batches

    def load_step(self, step: int) -> tuple[list, list[Batch], torch.cuda.Event | None]:
        """(plan, loaded micro-batches, the copy stream's event after them, or None off CUDA): runs on the loader
        thread, with its device work on a stream of its own, so that it overlaps the step in flight."""
        plan = self.micro_batches_for(step)
        if self.copy_stream is None:
            return plan, [self.load(mb) for mb in plan], None
        with torch.cuda.stream(self.copy_stream):
            batches = [self.load(mb) for mb in plan]
            return plan, batches, self.copy_stream.record_event()

    def load(self, micro_batch: list) -> Batch:
        if self.cfg.pack:
            return self.data.packed_batch(micro_batch, self.row_tokens, self.device)
        return self.data.batch(micro_batch, self.device)

    def real_tokens(self, micro_batch: list) -> int:
        """Non-padding tokens of a micro-batch."""
        if self.cfg.pack:
            return sum(end - start for row in micro_batch for _, start, end in row)
        return sum(self.data.lengths[k] for k in micro_batch)

    def micro_batches_for(self, step: int) -> list[list]:
        """This rank's micro-batches for global step `step` (a pure function of the step and, following, of the
        shards landed: epoch 0's micro-batches are the landed shards' plans, one after the other)."""
        if self.cfg.follow:
            self.await_micro_batches((step + 1) * self.world * self.cfg.grad_accum)
            if step < self.epoch0_steps:
                return rank_micro_batches(self.epoch0, step, self.world, self.cfg.grad_accum, self.rank)
            epoch, offset = divmod(step - self.epoch0_steps, self.steps_per_epoch)
            epoch += 1
        else:
            epoch, offset = divmod(step, self.steps_per_epoch)
        return rank_micro_batches(self.plan(train=True, epoch=epoch), offset, self.world, self.cfg.grad_accum,
                                  self.rank)

    # -- following a store that is being written (--follow) --------------------------------------------

    def start_following(self) -> None:
        """Epoch 0 starts empty and grows by `land`; the packed shape is the configured one (no shrink)."""
        self.train_idx, self.eval_idx, self.epoch0 = [], [], []
        self.train_pieces, self.eval_pieces = [], []
        self.landed, self.first_sample = 0, 0
        self.shard_ranges: list[tuple[int, int]] = []  # shard i's micro-batches: epoch0[a:b]
        self.shard_first: list[int] = []  # shard i's first global sample index
        self.deleted: set[int] = set()
        self.epoch0_steps = self.steps_per_epoch = math.inf  # until the writer marks the store complete
        if self.cfg.pack:
            self.row_tokens = self.cfg.row_tokens or self.cfg.batch_tokens
            self.rows_per_batch = self.cfg.batch_tokens // self.row_tokens
        self.land()

    def land(self) -> int:
        """Take in the shards the writer committed since the last call: check them (sha256, `sanity`), split each
        into train / eval, append its shuffled plan to epoch 0. Returns how many landed."""
        self.data.refresh()
        store = self.data.store
        shards = store.manifest["shards"]
        for i in range(self.landed, len(shards)):
            gone = self.cfg.delete_consumed and not (store.root / shards[i]["file"]).is_file()
            plan = self.consumed_plan(i) if gone else self.plan_shard(i)
            self.shard_first.append(self.first_sample)
            self.shard_ranges.append((len(self.epoch0), len(self.epoch0) + len(plan.micro_batches)))
            self.train_idx += plan.train
            self.eval_idx += plan.held
            self.train_pieces += plan.train_pieces
            self.eval_pieces += plan.eval_pieces
            self.epoch0 += plan.micro_batches
            self.first_sample += shards[i]["num_samples"]
        new, self.landed = len(shards) - self.landed, len(shards)
        if store.complete and self.epoch0_steps == math.inf:
            self.finish_following()
        return new

    def plan_shard(self, i: int) -> ShardPlan:
        """Shard i checked (sha256, `sanity`) and split into train / eval, its training share shuffled (and packed)
        on its own; with --delete-consumed, rank 0 keeps the plan and the held-back samples in OUT/consumed/."""
        store = self.data.store
        store.verify_shard(i)
        sane_shard(store.root, store.manifest["shards"][i], self.first_sample)
        tr, ev = split_indices(store.manifest["shards"][i]["num_samples"], self.cfg.eval_fraction)
        train, held = [self.first_sample + j for j in tr], [self.first_sample + j for j in ev]
        if self.cfg.pack:
            pieces, eval_pieces = (document_pieces(idx, self.data.lengths, self.row_tokens, self.cfg.pack_long,
                                                   self.data.loss_mask) for idx in (train, held))
            mbs = pack_plan(pieces, self.row_tokens, self.rows_per_batch, self.cfg.seed,
                            FOLLOW_SHARD_EPOCH + i) if pieces else []
        else:
            pieces, eval_pieces = [], []
            mbs = micro_batches(train, self.data.lengths, self.cfg.batch_tokens, self.cfg.seed, FOLLOW_SHARD_EPOCH + i)
        plan = ShardPlan(train, held, mbs, pieces, eval_pieces)
        if self.cfg.delete_consumed and self.rank == 0:
            self.keep_consumed(i, plan)
        return plan

    # -- --delete-consumed: what a deleted shard leaves behind, and when it goes -------------------------

    def plan_settings(self) -> dict:
        """The settings a shard's plan depends on (a resume must use the same)."""
        return {"seed": self.cfg.seed, "pack": self.cfg.pack, "batch_tokens": self.cfg.batch_tokens,
                "row_tokens": self.row_tokens if self.cfg.pack else None, "pack_long": self.cfg.pack_long,
                "rows_per_batch": self.rows_per_batch if self.cfg.pack else None,
                "eval_fraction": self.cfg.eval_fraction}

    def consumed_path(self, i: int, suffix: str) -> Path:
        return self.out / CONSUMED / f"shard-{i:05d}{suffix}"

    def keep_consumed(self, i: int, plan: ShardPlan) -> None:
        """Write shard i's held-back samples and then its plan (the plan's presence means both are complete)."""
        from draftsmith.capture.store import atomic_write_bytes, write_shard_file

        (self.out / CONSUMED).mkdir(parents=True, exist_ok=True)
        held_sha = None
        if plan.held:
            held_sha, _ = write_shard_file(self.consumed_path(i, ".safetensors"),
                                           [self.data.store.sample(k) for k in plan.held])
        record = {"shard_sha256": self.data.store.manifest["shards"][i]["sha256"], "held_sha256": held_sha,
                  "settings": self.plan_settings(), "plan": asdict(plan)}
        atomic_write_bytes(self.consumed_path(i, ".json"), json.dumps(record).encode())

    def consumed_plan(self, i: int) -> ShardPlan:
        """The plan of shard i, deleted by an earlier run into this --out, from OUT/consumed/; its held-back
        samples are read from there from now on.

        Raises:
            DraftsmithError: no record of it (another --out, or another run deleted it), or one made from
                another store or other settings.
        """
        from draftsmith.capture.store import sha256_file

        store, entry = self.data.store, self.data.store.manifest["shards"][i]
        path = self.consumed_path(i, ".json")
        if not path.is_file():
            raise DraftsmithError(f"feature-store shard {entry['file']} was deleted, and this run cannot rebuild it",
                                  got=f"no {entry['file']} in {store.root} and no {path}",
                                  expected="the shard, or the record of the --delete-consumed run that deleted it",
                                  fix="resume the run that deleted it (its --out), or recapture into a new store")
        record = json.loads(path.read_text())
        held_file = self.consumed_path(i, ".safetensors")
        problems = []
        if record["shard_sha256"] != entry["sha256"]:
            problems.append(f"shard sha256 {record['shard_sha256'][:16]}... (the store has {entry['sha256'][:16]}...)")
        if record["settings"] != self.plan_settings():
            problems.append(f"settings {record['settings']} (now {self.plan_settings()})")
        if record["held_sha256"] and not (held_file.is_file() and sha256_file(held_file) == record["held_sha256"]):
            problems.append(f"held-back samples {held_file} missing or changed")
        if problems:
            raise DraftsmithError(f"cannot resume over the deleted shard {entry['file']}", got="; ".join(problems),
                                  expected="the store, settings and OUT/consumed/ files of the run that deleted it",
                                  fix="resume with the original command, or recapture into a new store and --out")
        plan = ShardPlan.from_json(record["plan"], self.cfg.pack)
        first = self.first_sample
        store.set_aside(i, [k - first for k in plan.held], held_file if plan.held else None)
        self.deleted.add(i)
        return plan

    def delete_trained_shards(self) -> None:
        """After a checkpoint at step S: delete each shard no step after S reads (its micro-batches all lie in
        the first S steps; a shard holding one of epoch 0's first world*grad_accum - 1 micro-batches waits
        for epoch 0's end, whose last step wraps to them). A resume from this checkpoint never needs them."""
        per_step = self.world * self.cfg.grad_accum
        done, over = self.step * per_step, self.step >= self.epoch0_steps
        gone = [i for i, (a, b) in enumerate(self.shard_ranges) if i not in self.deleted and b <= done
                and (over or a == b or a >= per_step - 1)]
        if self.world > 1:  # rank 0 decides (ranks may differ in what they have landed); all close the files
            box = [gone]
            dist.broadcast_object_list(box, src=0)
            gone = box[0]
            if gone and self.landed <= max(gone):
                self.land()
        store = self.data.store
        for i in gone:
            held = [k - self.shard_first[i] for k in self.eval_idx
                    if self.shard_first[i] <= k < self.shard_first[i] + store.manifest["shards"][i]["num_samples"]]
            store.set_aside(i, held, self.consumed_path(i, ".safetensors") if held else None)
            if self.rank == 0:
                (store.root / store.manifest["shards"][i]["file"]).unlink(missing_ok=True)
            self.deleted.add(i)
        if gone:
            self.log({"step": self.step, "deleted_shards": [store.manifest["shards"][i]["file"] for i in gone]})

    def finish_following(self) -> None:
        per_step = self.world * self.cfg.grad_accum
        if not self.epoch0:
            raise DraftsmithError("nothing to train on", got=f"a complete store of {len(self.data)} samples",
                                  expected="samples with supervised tokens", fix="check the capture's conversations")
        self.epoch0_steps = -(-len(self.epoch0) // per_step)  # the last step wraps to the epoch's start
        self.steps_per_epoch = max(1, len(self.plan(train=True, epoch=1)) // per_step)
        if self.rank == 0:
            print(f"train: the store is complete: epoch 0 was {self.epoch0_steps} steps over {len(self.train_idx)} "
                  f"train samples; later epochs {self.steps_per_epoch} steps", flush=True)

    def await_micro_batches(self, n: int, poll_s: float = 0.5) -> None:
        """Block until epoch 0 holds `n` micro-batches or the store is complete."""
        last_growth = time.monotonic()
        while len(self.epoch0) < n and self.epoch0_steps == math.inf:
            if self.land():
                last_growth = time.monotonic()
            elif time.monotonic() - last_growth > self.cfg.follow_timeout_s:
                raise DraftsmithError("the feature store stopped growing before it was complete",
                                      got=f"{self.landed} shards, no new one for {self.cfg.follow_timeout_s:.0f} s",
                                      expected="new shards, or the writer's manifest marked complete",
                                      fix="check the capture; rerun it (it resumes) and this same train command")
            else:
                time.sleep(poll_s)

    def train_step(self) -> dict:
        """One optimizer step, waited for: its record (benchmarks and tests; the loop uses `launch_step`)."""
        return self.launch_step().resolve()

    def launch_step(self) -> "PendingStep":
        """Queue one optimizer step on the device and return without waiting for it: the loop resolves a step's
        record after it has queued the next one, so the host prepares step n+1 while the GPU runs step n."""
        from draftsmith.model.eagle3 import step_masks

        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plan, batches = self.step_batches(self.step)
        # Global denominators: supervised positions per TTT step over the whole global batch. One micro-batch in
        # one process is the whole global batch: the forward counts them itself (the same numbers), inside the
        # compiled region with --compile, instead of some 50 eager kernels here.
        denom = None
        if self.world > 1 or len(batches) > 1:
            denom = sum(step_masks(b.loss_mask, self.cfg.ttt_steps, b.documents).sum(dim=(1, 2)) for b in batches).float()
        if self.world > 1:
            dist.all_reduce(denom)
        self.optimizer.zero_grad(set_to_none=True)
        sums = None  # [loss, loss_sum (K), correct (K), count (K)] summed over the micro-batches
        for i, batch in enumerate(batches):
            out = self.forward(batch, denom)
            # DDP and FSDP average gradients over ranks; the loss is already global
            loss = out.loss * float(self.world) if self.world > 1 else out.loss
            last = i == len(batches) - 1
            if self.fsdp:
                self.drafter.set_requires_gradient_sync(last)
                loss.backward()
            elif self.world > 1 and not last:
                with self.model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            # Read now: with --cuda-graphs the next micro-batch's forward replays into the same output memory.
            part = torch.cat([out.loss.detach().view(1), out.loss_sum, out.correct_count, out.count]).float()
            sums = part if sums is None else sums + part
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        supervised = functools.reduce(torch.add, [b.loss_mask.sum() for b in batches]).float().view(1)
        # A fill kernel, not a copy: a tensor made from a host list would synchronise the stream here.
        real = torch.full((1,), float(sum(self.real_tokens(mb) for mb in plan)), device=self.device)
        stats = torch.cat([sums, real, supervised])
        if self.world > 1:
            dist.all_reduce(stats)
        stats = torch.cat([stats, grad_norm.detach().float().view(1)])
        return PendingStep(step=self.step + 1, ttt_steps=self.cfg.ttt_steps, lr=lr, t0=t0, stats=stats,
                           tokens=sum(int(b.loss_mask.numel()) for b in batches) * self.world,
                           shape=list(batches[0].input_ids.shape))

    # -- evaluation -----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Teacher-forced per-step accuracy and simulated acceptance on the held-back samples."""
        K = self.cfg.ttt_steps
        correct, count, loss, n = torch.zeros(K), torch.zeros(K), 0.0, 0
        walk = {k: [0.0, 0] for k in range(1, K + 1)}
        every = {k: [0.0, 0] for k in range(1, K + 1)}
        for mb in self.plan(train=False, epoch=0):
            out = self.forward(self.load(mb), None)
            correct += out.correct_count.cpu()
            count += out.count.cpu()
            loss += float(out.loss)
            n += 1
            for k in range(1, K + 1):
                for sums, fn in ((walk, engine_walk_acceptance), (every, simulated_acceptance)):
                    s, c = fn(out.correct, out.valid, k)
                    sums[k][0] += s
                    sums[k][1] += c
        return EvalResult(acc=(correct / count.clamp(min=1)).tolist(),
                          tau={k: s / max(c, 1) for k, (s, c) in walk.items()}, loss=loss / max(n, 1),
                          tau_all_starts={k: s / max(c, 1) for k, (s, c) in every.items()})

    # -- checkpoints ----------------------------------------------------------------------------------

    def full_states(self) -> tuple[dict | None, dict]:
        """(model state or None for the module's own, optimizer state); under FSDP gathered on every rank
        (a collective: all ranks call it) into full, unsharded tensors keyed by parameter name."""
        if not self.fsdp:
            return None, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(self.drafter, options=options),
                get_optimizer_state_dict(self.drafter, self.optimizer, options=options))

    def save(self, name: str) -> Path:
        path = self.out / "checkpoints" / name
        self.saved_at = self.step
        model_state, optim_state = self.full_states()
        if self.rank == 0:
            save_drafter(self.drafter, path, extra={"trained_steps": self.step, "store": self.cfg.store,
                                                    "target": self.data.target_name}, state=model_state)
            state = {"step": self.step, "optimizer": optim_state, "optimizer_layout": "fsdp" if self.fsdp else "torch",
                     "rng_cpu": torch.get_rng_state(), "rng_python": random.getstate()}
            if torch.cuda.is_available():
                state["rng_cuda"] = torch.cuda.get_rng_state_all()
            torch.save(state, path / "training_state.pt.tmp")
            os.replace(path / "training_state.pt.tmp", path / "training_state.pt")
            (self.out / "checkpoints" / "latest.tmp").write_text(name + "\n")
            os.replace(self.out / "checkpoints" / "latest.tmp", self.out / "checkpoints" / "latest")
        if self.world > 1:
            dist.barrier()
        if self.cfg.delete_consumed:
            self.delete_trained_shards()
        return path

    def try_resume(self) -> bool:
        latest = self.out / "checkpoints" / "latest"
        if not latest.is_file():
            return False
        path = self.out / "checkpoints" / latest.read_text().strip()
        drafter = load_drafter(path, self.data.embed_tokens())
        state = torch.load(path / "training_state.pt", weights_only=True)
        layout = state.get("optimizer_layout", "torch")
        if layout != ("fsdp" if self.fsdp else "torch"):
            raise DraftsmithError("checkpoint written under another --parallel mode", got=f"{layout} optimizer state in {path}",
                                  expected="fsdp" if self.fsdp else "ddp / single process",
                                  fix="resume with the --parallel mode the run was started with")
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.drafter, drafter.state_dict(), options=options)
            set_optimizer_state_dict(self.drafter, self.optimizer, state["optimizer"], options=options)
        else:
            self.drafter.load_state_dict(drafter.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = self.saved_at = int(state["step"])
        torch.set_rng_state(state["rng_cpu"])
        random.setstate(state["rng_python"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        return True

    # -- the loop -------------------------------------------------------------------------------------

    def log(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def report(self, pending: PendingStep | None, bar, first: bool = False, end: float | None = None) -> None:
        """Wait for a queued step, then log, print and count it; None, for the caller's `pending`. `first`: the
        run's first step (compile and warm-up), reported apart; `end`: `PendingStep.resolve`'s."""
        if pending is None:
            return None
        record = pending.resolve(end)
        if first:
            self.first_step_done = True
            record["first_step"] = True
            self.log({"step": record["step"], "first_step_s": record["ms"] / 1000, "compile": self.cfg.compile,
                      "shape": record["shape"]})
            if self.rank == 0:
                print(f"train: first step {record['ms'] / 1000:.1f} s ({'compile + ' if self.cfg.compile else ''}"
                      f"warm-up; micro-batch shape {record['shape']})", flush=True)
        self.log(record)
        if self.rank == 0 and record["step"] % self.cfg.log_every == 0:
            print(step_line(record, self.total_steps), flush=True)
        bar.advance(1, tokens=None, note=f"loss {record['loss']:.3f}")
        return None

    def layout_note(self) -> str:
        """The start line's words on the drafter's norms: which engines can serve what this run trains."""
        norms = [f for f in NORM_VARIANTS if getattr(self.layout, f)]
        if not norms:
            return "no norm variants (every engine serves it)"
        from draftsmith.conventions import unread_norms

        source = "the starting drafter's" if self.cfg.init_from else f"recipe {self.cfg.recipe}"
        unserved = [name for fmt, name in (("vllm", "vLLM"), ("llamacpp", "llama.cpp"), ("sglang", "SGLang"))
                    if unread_norms(self.layout._asdict(), fmt)]
        served = [name for name in ("vLLM", "llama.cpp", "SGLang") if name not in unserved]
        serve = "serves" if len(served) == 1 else "serve"
        note = f"{', '.join(norms)} ({source}; {' and '.join(served)} {serve} it"
        if not unserved:
            return note + ")"
        do_not = "does not" if len(unserved) == 1 else "do not"
        return note + f", {' and '.join(unserved)} {do_not}: --recipe plain trains a drafter every engine serves)"

    def run(self, progress: bool = True) -> EvalResult:
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self.try_resume()
        if self.rank == 0:
            (self.out / "train_config.json").write_text(json.dumps({**self.cfg.model_dump(), "peak_lr": self.cfg.peak_lr,
                                                                   "layout": self.layout._asdict()}, indent=2) + "\n")
            packing = (f"packed rows of {self.row_tokens} tokens x {self.rows_per_batch} per micro-batch "
                       f"({len(self.train_pieces)} documents)" if self.cfg.pack
                       else "unpacked")
            print(f"train: {len(self.train_idx)} train / {len(self.eval_idx)} eval samples, {packing}, {self.total_steps} "
                  f"steps ({self.steps_per_epoch}/epoch), world {self.world}, device {self.device}, draft head "
                  f"{'from --init-from' if self.cfg.init_from else self.layout.head_init}"
                  f"{'' if self.layout.train_head else ', frozen'}, {self.layout_note()}"
                  + (f", resumed at step {self.step}" if resumed else ""))
        from draftsmith.progress import progress_bar

        start = self.evaluate_start(resumed)
        with progress_bar("train", total=self.total_steps, unit="steps") if self.rank == 0 and progress \
                else _null_bar() as bar:
            if resumed:
                bar.advance(self.step)
            per_step = self.world * self.cfg.grad_accum
            pending: PendingStep | None = None  # the step in flight, reported once the next one is queued
            while self.step < self.stop_step:
                if self.cfg.follow:  # the store may complete here, and with --delete-consumed end the run
                    pending = self.report(pending, bar)  # waiting on the writer must not count as step time
                    self.await_micro_batches((self.step + 1) * per_step)
                    if self.step >= self.stop_step:
                        break
                if self.step % self.cfg.eval_every == 0 and self.step > 0:
                    pending = self.report(pending, bar)
                    self.log_eval(self.evaluate())
                launched = self.launch_step()
                self.step += 1
                pending = self.report(pending, bar, end=launched.t0)  # step n-1, read while step n runs
                pending = launched
                if not self.first_step_done:  # compile (--compile) and warm-up happen here: reported apart
                    pending = self.report(pending, bar, first=True)
                if self.step % self.cfg.save_every == 0 or self.step == self.stop_step:
                    pending = self.report(pending, bar)
                    self.save(f"step-{self.step:06d}")
            pending = self.report(pending, bar)
            if self.saved_at != self.step:  # --delete-consumed: ended by the store's end, found after the last step
                self.save(f"step-{self.step:06d}")
        result = self.evaluate()
        self.log_eval(result)
        model_state, _ = self.full_states()
        if self.rank == 0:
            result = self.write_drafter(result, start, model_state)
        return result

    def evaluate_start(self, resumed: bool) -> EvalResult | None:
        """With --init-from and --keep-start: the starting drafter on the held-back samples, before the first step
        (a resumed run reads it back from metrics.jsonl). None when there is nothing to compare against."""
        if not (self.cfg.init_from and self.cfg.keep_start) or self.cfg.follow or not self.eval_idx:
            return None
        if resumed:
            return read_start_eval(self.out / "metrics.jsonl")
        result = self.evaluate()
        self.log({"step": 0, "eval": asdict(result), "starting_drafter": True})
        if self.rank == 0:
            print(f"eval  00000 | starting drafter ({self.cfg.init_from}) | loss {result.loss:.3f} | simulated tau[k] "
                  + " ".join(f"{k}:{v:.2f}" for k, v in result.tau.items()), flush=True)
        return result

    def write_drafter(self, result: EvalResult, start: EvalResult | None, model_state: dict | None) -> EvalResult:
        """Write OUT/drafter: the fine-tuned drafter, or the starting one unchanged when fine-tuning did not raise
        held-back simulated tau at k = ttt_steps (`keep_start`). Returns the written drafter's held-back result."""
        extra = {"trained_steps": self.step, "store": self.cfg.store, "target": self.data.target_name}
        K = self.cfg.ttt_steps
        if start is None or result.tau[K] > start.tau[K]:
            if start is not None:
                extra["selection"] = selection("fine-tuned", start, result, K)
            save_drafter(self.drafter, self.out / "drafter", extra={**extra, "eval": asdict(result)}, state=model_state)
            return result
        print(f"train: fine-tuning did not raise held-back simulated tau at k={K} ({start.tau[K]:.2f} -> "
              f"{result.tau[K]:.2f}): {self.out / 'drafter'} is the starting drafter ({self.cfg.init_from}) unchanged; "
              "--no-keep-start (run: train.keep_start=false) writes the fine-tuned one", flush=True)
        starting = self.starting_drafter()  # grown as this run started it, when --draft-vocab-size grew it
        save_drafter(starting, self.out / "drafter",
                     extra={**extra, "eval": asdict(start), "selection": selection("starting", start, result, K)})
        return start

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """`with Trainer(cfg) as trainer:` closes it on the way out; after an error only its loader stops (a
        barrier would wait on ranks that did not fail; the launcher ends them)."""
        if exc_type is None:
            self.close()
        else:
            self.stop_loader()

    def stop_loader(self) -> None:
        if self.loader is not None:  # a prefetch in flight holds batches on the device: wait for it, then stop
            self.loader.shutdown(wait=True)
            self.loader, self.prefetched = None, {}

    def close(self) -> None:
        """End a multi-process run in an order that cannot abort the process at exit.

        The abort seen once under FSDP2 (issue 21: rank 0 SIGABRT, "terminate called without an active
        exception") is what a C++ thread gets when it needs the GIL during interpreter finalization: gloo runs
        collectives on worker threads, and the last reference to a finished work and its tensors can drop there
        (pytorch/pytorch#179291 describes this path; #190489 the same message without destroy_process_group).
        Before, rank 1 tore down while rank 0 still wrote the drafter, and FSDP2's hooks and DTensors, in
        reference cycles with the modules, kept the process group and its works alive until some later garbage
        collection, possibly the one during finalization. Now, on every rank: a barrier (no collective in flight
        anywhere, rank 0's last file written), then the model, its FSDP2 / DDP state and the optimizer dropped
        and collected while the interpreter is whole, then the process group destroyed.
        """
        self.stop_loader()
        if not dist.is_initialized():
            return
        dist.barrier()
        self.model = self.drafter = self.optimizer = self.target_head = None
        gc.collect()
        dist.destroy_process_group()
        gc.collect()

    def log_eval(self, result: EvalResult) -> None:
        if not self.eval_idx:
            return
        self.log({"step": self.step, "eval": asdict(result)})
        if self.rank == 0:
            taus = " ".join(f"{k}:{v:.2f}" for k, v in result.tau.items())
            print(f"eval  {self.step:05d} | loss {result.loss:.3f} | acc {' '.join(f'{a:.2f}' for a in result.acc)} "
                  f"| simulated tau[k] (engine walk) {taus}", flush=True)


class _null_bar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, *args, **kwargs):
        pass


def step_line(r: dict, total: int) -> str:
    """The one greppable line per step (docs/design.md, "Measured output")."""
    acc = " ".join(f"{a:.2f}" for a in r["acc"])
    return (f"step {r['step']:05d}/{total:05d} | loss {r['loss']:.3f} | acc[k] {acc} | lr {r['lr']:.2e} "
            f"| {r['ms']:.0f} ms | {r['tok_per_s']:,.0f} tok/s" + (" (first step: compile / warm-up)" if r.get("first_step") else ""))


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("train", help="train an EAGLE-3 drafter with training-time test",
                       **example_help(
                           "examples:\n"
                           "  draftsmith train --store runs/demo/store --out runs/demo/train --epochs 2 --lr 5e-4\n"
                           "  draftsmith train --conversations conv.jsonl --target smollm2 --out runs/online   # online\n"
                           "  torchrun --nproc-per-node 2 -m draftsmith train --store STORE --out OUT          # DDP\n"
                           "  torchrun --nproc-per-node 8 -m draftsmith train --store STORE --out OUT --parallel fsdp\n"
                           "  draftsmith train --store STORE --follow --max-steps 20000 --out OUT  # while capture writes STORE\n"
                           "  draftsmith train --store STORE --follow --delete-consumed --max-steps 20000 --out OUT  # bounded disk\n"
                           "A killed run resumes from its last checkpoint when the same command is run again."))
    add_flags(p, TrainConfig, required=("out",),
              helps={"aux_ids": "online only: boundary aux ids, e.g. 2,15,27 (default 2,N//2,N-3)"})
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    with Trainer(from_flags(TrainConfig, args)) as trainer:
        result = trainer.run(progress=not args.quiet)
        if trainer.rank == 0:
            print(f"train: drafter -> {Path(args.out) / 'drafter'} | simulated tau at k=4: "
                  f"{result.tau.get(4, float('nan')):.2f} | acc {' '.join(f'{a:.2f}' for a in result.acc)}")
    return 0
