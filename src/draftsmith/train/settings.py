"""How a drafter is trained: the `train` verb's settings (TrainSettings, TrainConfig), the two recipes (normed,
plain) and the drafter `run` starts from (`starting_drafter`: train.init_from resolved).

    cfg = TrainConfig(out="runs/demo/train", store="runs/demo/store", recipe=recipe_for("auto", ("vllm",)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from typing import Literal

from pydantic import Field, model_validator

from draftsmith.config import Settings
from draftsmith.conventions import NORM_VARIANTS, unread_by_format, unread_norms
from draftsmith.errors import DraftsmithError
from draftsmith.model.dflash import DFLASH_BLOCK_SIZE, DFLASH_LAYERS, DFLASH_LOSS_GAMMA, DFLASH_NUM_ANCHORS
from draftsmith.model.eagle3 import TTT_STEP_LOSS_DECAY, TTT_STEPS, DrafterConfig

SCRATCH_LR = 1e-3
"""Default peak lr of a new drafter (TrainSettings.lr)."""
FINE_TUNE_LR = 2e-4
"""Default peak lr with --init-from: the shipped-drafter fine-tunes of `run` and the embedded builds use it."""


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
    if recipe != "auto":
        return recipe
    normed = RECIPES[DEFAULT_RECIPE]._asdict()
    return "plain" if any(unread_norms(normed, f) for f in formats) else DEFAULT_RECIPE


class TrainSettings(Settings):
    """How a drafter is trained, whatever the data: the `train` verb's flags and `run`'s train section."""

    family: Literal["eagle3", "dflash"] = "eagle3"
    """The drafter family: eagle3 (a one-layer chain drafter trained with training-time test) or dflash (a
    block-diffusion drafter that proposes --block-size - 1 tokens in one forward, arXiv 2602.06036; its own settings
    below, EAGLE-3's draft vocabulary, TTT and recipe settings do not apply)."""
    block_size: int = Field(DFLASH_BLOCK_SIZE, ge=2, le=64)
    """dflash: tokens per block, the anchor plus block_size - 1 masks (z-lab's drafters: 16)."""
    mask_token_id: int | None = Field(None, ge=0)
    """dflash: the vocabulary id of the mask token, one that never occurs in the data (SmolLM2: 16,
    <empty_output>); required with --family dflash."""
    num_anchors: int = Field(DFLASH_NUM_ANCHORS, ge=1)
    """dflash: blocks sampled per row, at supervised positions whose block fits in its document."""
    loss_gamma: float = Field(DFLASH_LOSS_GAMMA, gt=0)
    """dflash: block position k's loss weight is exp(-(k-1)/gamma) (the paper: 7 for block size 16)."""
    drafter_layers: int = Field(DFLASH_LAYERS, ge=1, le=64)
    """dflash: decoder layers of a new drafter (z-lab's Qwen3-8B drafter: 5)."""
    draft_vocab_size: int | None = Field(None, ge=1)
    """Draft vocabulary size (default: vocab.default_draft_vocab_size). With init_from, a size above the starting
    drafter's grows its vocabulary (its tokens, then this data's most frequent others; a new token's head row
    starts as the target's); a smaller one or none keeps the starting drafter's."""
    ttt_steps: int = Field(TTT_STEPS, ge=1, le=32)
    """Training-time-test unroll length (EAGLE-3 / SpecForge: 7)."""
    step_loss_decay: float = Field(TTT_STEP_LOSS_DECAY, gt=0, le=1)
    """Weight of TTT step i is decay**i (EAGLE-3: 0.8)."""
    lr: float | None = Field(None, gt=0, le=1.0)
    """Peak learning rate of the cosine schedule; default 1e-3 for a new drafter, 2e-4 with --init-from
    (fine-tuning a trained one). On one H200 epoch of 3 M SmolLM2 tokens, 1e-3 drafted tau 1.67 at k=4 against
    1.36 at SpecForge's 1e-4 (2e-3: 1.65; docs/peers.md, "speculators' defaults against draftsmith's"); long
    runs on large data may prefer 1e-4."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_ratio: float = Field(0.015, ge=0, le=1)
    """Share of steps with linear warm-up (SpecForge 0.015)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    clip: float = Field(0.5, gt=0)
    """Gradient-norm clip (EAGLE, SpecForge)."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the training split (fractions allowed)."""
    max_steps: int | None = Field(None, ge=1, le=1_000_000_000)
    """Stop after this many optimizer steps (overrides epochs)."""
    batch_tokens: int = Field(4096, ge=1, le=2**31 - 1)
    """Tokens per micro-batch, padding included (packed: batch_tokens // row_tokens rows)."""
    pack: bool = True
    """Pack whole conversations into rows of --row-tokens with document masks (positions restart per
    conversation, attention stays inside it): one tensor shape for the whole run, so a compiled step never
    recompiles, and little padding. --no-pack: one conversation per row, padded to the micro-batch's longest."""
    row_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    """Packed row length (default: batch_tokens)."""
    pack_long: str = "split"
    """Packing, conversations longer than a row: split (into pieces ending at assistant-turn ends, or at the row
    length where a turn is longer) or truncate (keep the first row)."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step and process."""
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of samples held back for evaluation (fixed split)."""
    eval_every: int = Field(100, ge=1)
    """Evaluate every N steps (and at the end)."""
    save_every: int = Field(100, ge=1)
    """Checkpoint every N steps (and at the end)."""
    log_every: int = Field(1, ge=1)
    """Print the step line every N steps (metrics.jsonl gets every step)."""
    seed: int = Field(0, ge=0)
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
        if self.family == "dflash" and self.mask_token_id is None:
            raise DraftsmithError("--family dflash needs a mask token", got="no --mask-token-id",
                                  expected="a vocabulary id that never occurs in the data",
                                  fix="pass --mask-token-id ID: a special token of the target's tokenizer that "
                                      "chat never uses (SmolLM2: 16, <empty_output>)")
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
    """Online only: boundary aux ids (eagle3: default 2, N//2, N-3; dflash: any count, default 5 spread from layer
    output 1 to N-3 as z-lab's drafters). Offline runs use the store's (dflash: as many as it has)."""
    max_length: int = Field(2048, ge=1)
    """Online only: truncate conversations to this many tokens."""
    overwrite: bool = False
    """Start over in an --out that holds another run (or files train did not write): delete what train wrote
    there (checkpoints, metrics, the drafter, its records), nothing else. Without it, train continues the run in
    --out only when it was trained with the same settings (train/resume.py: RESUMABLE names what may change)."""

    follow: bool = False
    """Train on a store that is still being written (a capture running into --store): epoch 0 takes each shard
    as it lands, in landing order, shuffled and packed within the shard, and ends when the writer marks the
    store complete; later epochs shuffle over every sample. The eval split is made per shard. Needs --max-steps
    (the store's size is not known at the start)."""
    follow_timeout_s: float = Field(3600.0, gt=0)
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


@dataclass(frozen=True)
class Start:
    """train.init_from resolved: the drafter training starts from (None: from scratch), and why."""

    drafter: str | None
    why: str


def starting_drafter(init_from: str | None, target: str, formats: tuple[str, ...] = ()) -> Start:
    """train.init_from resolved: `auto` is the drafter shipped for the target when there is one and every engine of
    `formats` computes its norm variants (the smollm2 drafter is normed: not for SGLang), else none (from scratch)."""
    from draftsmith.model.checkpoint import shipped_drafter

    if init_from != "auto":
        return Start(init_from, "null" if not init_from else "set")
    shipped = shipped_drafter(target)
    if shipped is None:
        return Start(None, "auto, no drafter is shipped for this target")
    if unread := unread_by_format(shipped, formats):
        engines, verb = ", ".join(unread), "does" if len(unread) == 1 else "do"
        norms = ", ".join(sorted({f for fs in unread.values() for f in fs}))
        return Start(None, f"auto, the shipped drafter is normed and {engines} {verb} not compute its {norms}")
    return Start(target, "auto, the drafter shipped for this target")


def layout_note(layout: Layout, init_from: str | None, recipe: str) -> str:
    """The start line's words on a drafter's norms: which engines can serve what a run trains."""
    norms = [f for f in NORM_VARIANTS if getattr(layout, f)]
    if not norms:
        return "no norm variants (every engine serves it)"
    source = "the starting drafter's" if init_from else f"recipe {recipe}"
    unserved = [name for fmt, name in (("vllm", "vLLM"), ("llamacpp", "llama.cpp"), ("sglang", "SGLang"))
                if unread_norms(layout._asdict(), fmt)]
    served = [name for name in ("vLLM", "llama.cpp", "SGLang") if name not in unserved]
    serve = "serves" if len(served) == 1 else "serve"
    note = f"{', '.join(norms)} ({source}; {' and '.join(served)} {serve} it"
    if not unserved:
        return note + ")"
    do_not = "does not" if len(unserved) == 1 else "do not"
    return note + f", {' and '.join(unserved)} {do_not}: --recipe plain trains a drafter every engine serves)"
