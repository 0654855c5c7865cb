"""The drafter a run trains: a new one (the data's draft vocabulary, the recipe's norms and head, a seeded
initialisation) or the --init-from one (loaded, checked against the target, its vocabulary grown when
--draft-vocab-size asks for more).

    drafter = new_drafter(data, cfg, cfg.layout(), announce=True)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from draftsmith.conventions import NORM_VARIANTS
from draftsmith.errors import DraftsmithError
from draftsmith.model.checkpoint import drafter_path, load_drafter
from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter, with_draft_vocab
from draftsmith.model.vocab import build_draft_vocab, default_draft_vocab_size, grow_draft_vocab
from draftsmith.train.features import FeatureSource
from draftsmith.train.settings import Layout, TrainConfig


def check_draft_vocab_size(size: int | None, vocab_size: int) -> None:
    """A draft vocabulary is a subset of the target's: refuse a larger size before a (V_d x H) head is built."""
    if size is not None and size > vocab_size:
        raise DraftsmithError("--draft-vocab-size is larger than the target's vocabulary", got=str(size),
                              expected=f"<= {vocab_size} (the target's vocabulary)",
                              fix=f"e.g. --draft-vocab-size {default_draft_vocab_size(vocab_size)}, or leave it out")


def load_starting_drafter(data: FeatureSource, cfg: TrainConfig, announce: bool = False) -> Eagle3Drafter:
    """The --init-from drafter as this run starts it: loaded, checked against the target, and grown to
    --draft-vocab-size when that is larger than its own vocabulary (`vocab.grow_draft_vocab`); `announce`
    prints the growth."""
    spec = data.target_spec
    check_draft_vocab_size(cfg.draft_vocab_size, spec.vocab_size)
    drafter = load_drafter(drafter_path(cfg.init_from), data.embed_tokens())
    if drafter.config.vocab_size != spec.vocab_size or drafter.config.target_hidden_size != spec.hidden_size:
        raise DraftsmithError("--init-from drafter does not fit this target",
                              got=f"vocab {drafter.config.vocab_size}, target hidden "
                              f"{drafter.config.target_hidden_size}",
                              expected=f"vocab {spec.vocab_size}, target hidden {spec.hidden_size}",
                              fix="initialise from a drafter trained for this target")
    size = cfg.draft_vocab_size
    if size is None or size <= drafter.config.draft_vocab_size:  # smaller or none: the start's vocabulary
        return drafter
    counts = data.token_counts()
    vocab = grow_draft_vocab(drafter.d2t, counts, size)
    if announce:
        before = counts[drafter.t2d].sum().item() / max(counts.sum().item(), 1)
        print(f"draft vocabulary grown from the starting drafter's {drafter.config.draft_vocab_size} to {size} "
              f"tokens: coverage of this data's supervised tokens {before:.4f} -> {vocab.coverage:.4f}", flush=True)
    return with_draft_vocab(drafter, vocab.d2t, vocab.t2d, data.target_head())


def new_drafter(data: FeatureSource, cfg: TrainConfig, layout: Layout, announce: bool = False) -> Eagle3Drafter:
    """A new drafter for the data's target: the draft vocabulary of its most frequent supervised tokens, the
    layout's norms and head, weights seeded by --seed; `announce` prints the vocabulary's coverage."""
    spec = data.target_spec
    check_draft_vocab_size(cfg.draft_vocab_size, spec.vocab_size)
    size = cfg.draft_vocab_size or default_draft_vocab_size(spec.vocab_size)
    vocab = build_draft_vocab(data.token_counts(), size)
    torch.manual_seed(cfg.seed)
    norms = {f: getattr(layout, f) for f in NORM_VARIANTS}
    drafter = Eagle3Drafter(replace(DrafterConfig.from_target(spec, size, data.aux_ids), **norms))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(data.embed_tokens())
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
        if layout.head_init == "target":  # (V_d, H): the target's head rows, in draft-id order
            drafter.lm_head.weight.copy_(data.target_head()[vocab.token_ids])
    if announce:
        print(f"draft vocabulary: the {size} most frequent of this data's supervised tokens, coverage "
              f"{vocab.coverage:.4f}", flush=True)
    return drafter
