"""Train a drafter, offline or online: `Trainer`, the one explicit loop, for both families (`--family`): an
EAGLE-3 drafter with training-time test, or a DFlash drafter on blocks at sampled anchors (model/dflash.py). The
family decides the model and its forward's arguments (`build_drafter`, `forward`, `denominators`); the loop,
packing, resume, distribution, evaluation and the step line are the same. Per-step statistics are per TTT step
for EAGLE-3 and per block position (1..block size - 1) for DFlash, which also reports its expected block acceptance.

- offline: features come from a feature store (`draftsmith capture`);
- online: the target runs in the training process over a conversations file (no store).

One explicit loop: periodic eval / checkpoint -> micro-batch forward / backward -> clip -> step -> log.
The learning rate is a pure function of the step (`lr_at`), the data order a pure function of
(seed, epoch) (`packing`), so a checkpoint needs only the weights, the optimizer and the step to resume
exactly (`resume`). Micro-batches are packed by default (`packing.pack_plan`): rows of a fixed length holding
whole conversations with document masks, so every step has the same tensor shape (a compiled step never
recompiles) and little padding; `--no-pack` pads one conversation per row instead.
Runs unchanged under `torchrun --nproc-per-node N` (DDP or FSDP2: `distributed`; gloo on CPU, NCCL on GPU): the
loss is normalised by the supervised-token count of the whole global batch, so N processes with the same global
batch compute the same update as one process with gradient accumulation.
`--follow` trains on a store while a capture still writes it (`shards.ShardFeed`).

    with Trainer(TrainConfig(store="runs/demo/store", out="runs/demo/train", epochs=2)) as trainer:
        result = trainer.run()

The verb is `command` (draftsmith train --store runs/demo/store --out runs/demo/train --epochs 2).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from draftsmith.errors import DraftsmithError
from draftsmith.outputs import hold, mark
from draftsmith.model.checkpoint import drafter_path, load_drafter, save_drafter
from draftsmith.model import dflash
from draftsmith.model.dflash import DFlashConfig, DFlashDrafter
from draftsmith.model.eagle3 import (Eagle3Drafter, TTTOutput, compile_for_training, engine_walk_acceptance,
                                     simulated_acceptance, step_masks)
from draftsmith.target import pick_device
from draftsmith.train.distributed import join_process_group, parallel_model
from draftsmith.train.drafter import load_starting_drafter, new_drafter
from draftsmith.train.features import Batch, FeatureSource, OnlineSource, StoreSource, feature_dtype
from draftsmith.train.packing import epoch_plan, packed_shape, rank_micro_batches, split_indices, split_samples
from draftsmith.train.resume import (RECORD, check_out, check_settings, full_states, latest_checkpoint, record,
                                     restore, start_over, write_checkpoint)
from draftsmith.train.settings import TrainConfig, layout_note
from draftsmith.train.shards import ShardFeed, wait_published


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak lr, then cosine down to it times min_lr_ratio."""
    warmup = max(1, int(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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


@dataclass
class PendingStep:
    """A step queued on the device (`Trainer.launch_step`): its statistics stay there until `resolve` reads them
    (the one CPU-GPU sync of a step)."""

    step: int
    ttt_steps: int
    lr: float
    t0: float
    stats: torch.Tensor  # [loss, loss_sum (K), correct (K), count (K), (DFlash: accepted, blocks,) real, supervised,
    # grad_norm], summed over ranks
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
        block = {"block_tau": stats[3 * K + 1] / max(stats[3 * K + 2], 1)} if len(stats) == 3 * K + 6 else {}
        return {**block, "step": self.step, "loss": stats[0], "loss_per_step": [s / max(c, 1) for s, c in zip(stats[1:K + 1], counts)],
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
        self.world, self.rank, self.device = join_process_group(pick_device(cfg.device))
        if cfg.overwrite:
            self.start_over()
        self.autocast = self.device.type == "cuda"  # bf16 autocast, fp32 master weights
        if cfg.follow and data is None:
            wait_published(Path(cfg.store), cfg.follow_timeout_s)
        self.data: FeatureSource = data or (StoreSource(Path(cfg.store), cfg.follow) if cfg.store else
                                            OnlineSource(Path(cfg.conversations), cfg.target, cfg.aux_ids, cfg.max_length,
                                                         self.device, cfg.family))
        self.feed: ShardFeed | None = None  # --follow: the store as it lands
        if cfg.follow:
            self.start_following()
        else:
            self.split_data()
        # The most rows (B x T) a micro-batch has: the head groups the TTT steps of every micro-batch for it, so a
        # compiled unpacked run does not recompile per grouping (`ttt_forward`'s head_rows). A followed store's
        # unpacked samples are not all known yet: the head then groups per batch.
        self.head_rows = (self.rows_per_batch * self.row_tokens if cfg.pack else
                          None if cfg.follow else max([cfg.batch_tokens, *self.data.lengths]))
        self.dflash = cfg.family == "dflash"
        self.positions = cfg.block_size - 1 if self.dflash else cfg.ttt_steps
        """K of the per-step statistics: TTT steps, or DFlash's block positions 1..block size - 1."""
        self.drafter = self.build_drafter().to(self.device)
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        if self.dflash:  # the target's embedding, frozen, passed to each forward (no part of the drafter)
            self.target_embed = self.data.embed_tokens().to(self.device, feature_dtype(self.device))
        else:
            self.drafter.lm_head.weight.requires_grad_(self.layout.train_head)
            if not self.fsdp:  # the frozen embedding is a lookup: in the features' dtype (FSDP2 wants one dtype)
                self.drafter.embed_tokens.to(feature_dtype(self.device))
        # In the features' dtype (bf16 on GPU: ttt_forward computes in it anyway; half the memory of fp32).
        self.target_head = self.data.target_head().to(self.device, feature_dtype(self.device))
        if cfg.compile and self.dflash:
            dflash.compile_for_training(self.drafter)
        elif cfg.compile:
            compile_for_training(self.drafter, cuda_graphs=cfg.cuda_graphs)
            if cfg.cuda_graphs:  # the same tensor every step: a replay reads it in place instead of copying it in
                torch._dynamo.mark_static_address(self.target_head)
        self.model = parallel_model(self.drafter, self.device, self.world, self.fsdp)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                           fused=self.device.type == "cuda")
        self.per_step = self.world * cfg.grad_accum  # micro-batches of one optimizer step, all ranks
        if not cfg.follow:  # following: known once the store is complete (`ShardFeed.finish`)
            self.epoch_steps = max(1, len(self.plan(train=True, epoch=0)) // self.per_step)
        self.total_steps = cfg.max_steps or max(1, int(cfg.epochs * self.steps_per_epoch))
        """The learning-rate schedule's length (`stop_step` is where the loop ends)."""
        self.step = self.saved_at = 0
        self.first_step_done = False  # the first step of this process compiles / warms up: logged apart
        self.loader: ThreadPoolExecutor | None = None  # `step_batches`: loads the next step's micro-batches
        self.prefetched: dict[int, Future] = {}
        self.copy_stream: torch.cuda.Stream | None = None

    def start_over(self) -> None:
        """--overwrite: rank 0 deletes what train wrote into --out (after `check_out` allowed it), before the data
        is read (a --delete-consumed run reads OUT/consumed/); the other ranks wait for it."""
        check_out(self.cfg, self.world)
        if self.rank == 0:
            if self.out.is_dir():  # one process writes a run folder: held before anything in it is deleted
                hold(self.out, "train")
            start_over(self.out)
        if self.world > 1:
            dist.barrier()

    def split_data(self) -> None:
        """The fixed split of a whole store or conversations file, and the packed shape it fills."""
        train_idx, eval_idx = split_indices(len(self.data), self.cfg.eval_fraction)
        if not train_idx:
            raise DraftsmithError("nothing to train on", got=f"{len(self.data)} samples with supervised tokens",
                                  expected="at least 2 (one is held back for evaluation)",
                                  fix="regenerate more conversations (or check that they have assistant turns)")
        if self.cfg.pack:
            self.row_tokens, self.rows_per_batch = packed_shape(self.data.lengths, train_idx, self.cfg)
        self.split = split_samples(train_idx, eval_idx, self.data.lengths, self.row_tokens if self.cfg.pack else None,
                                   self.cfg.pack_long, self.data.loss_mask)

    def start_following(self) -> None:
        """Epoch 0 starts empty and grows as the writer lands shards (`ShardFeed`); the packed shape is the
        configured one (no shrink)."""
        if self.cfg.pack:
            self.row_tokens = self.cfg.row_tokens or self.cfg.batch_tokens
            self.rows_per_batch = self.cfg.batch_tokens // self.row_tokens
        self.feed = ShardFeed(self.data, self.cfg, self.out, self.pack_shape, self.world, self.rank)
        self.split = self.feed.split  # grows as the feed lands shards

    @property
    def pack_shape(self) -> tuple[int, int] | None:
        """(row tokens, rows per micro-batch) of a packed run, None unpacked."""
        return (self.row_tokens, self.rows_per_batch) if self.cfg.pack else None

    @property
    def steps_per_epoch(self) -> int | float:
        """Steps of a whole-data epoch; following, of epochs 1, 2, ... (inf until the store is complete)."""
        return self.feed.steps_per_epoch if self.feed else self.epoch_steps

    @property
    def stop_step(self) -> int | float:
        """Where the loop ends: total_steps, or with --delete-consumed the end of epoch 0 when that comes first
        (infinite until the store is complete; the schedule still spans total_steps, so when the writer
        finishes changes no step's learning rate)."""
        return min(self.total_steps, self.feed.epoch0_steps) if self.cfg.delete_consumed else self.total_steps

    def build_drafter(self) -> Eagle3Drafter | DFlashDrafter:
        """The drafter this run trains (the --init-from one, or a new one), and its layout (`self.layout`)."""
        if self.dflash:
            self.layout = self.cfg.layout()
            return self.new_dflash()
        if self.cfg.init_from:
            drafter = load_starting_drafter(self.data, self.cfg, announce=self.rank == 0)
            self.layout = self.cfg.layout(drafter.config)
            return drafter
        self.layout = self.cfg.layout()
        return new_drafter(self.data, self.cfg, self.layout, announce=self.rank == 0)

    def new_dflash(self) -> DFlashDrafter:
        """A DFlash drafter for the data's target and aux layers (--init-from: that one, which must be DFlash)."""
        cfg, spec = self.cfg, self.data.target_spec
        if cfg.init_from:
            drafter = load_drafter(drafter_path(cfg.init_from))
            if not isinstance(drafter, DFlashDrafter) or drafter.config.block_size != cfg.block_size:
                raise DraftsmithError("--init-from drafter is not a DFlash drafter of this block size",
                                      got=f"{type(drafter).__name__} from {cfg.init_from}",
                                      expected=f"a DFlash drafter with block size {cfg.block_size}",
                                      fix="initialise from a DFlash drafter, or train from scratch")
            return drafter
        torch.manual_seed(cfg.seed)
        return DFlashDrafter(DFlashConfig.from_target(spec, self.data.aux_ids, cfg.block_size, cfg.mask_token_id,
                                                      cfg.drafter_layers))

    # -- one optimizer step ---------------------------------------------------------------------------

    def anchors(self, batch: Batch, seed: tuple[int, ...]) -> dflash.Anchors:
        """DFlash: a batch's anchors, from a generator seeded by (seed, step or eval, rank, micro-batch): the same
        blocks on a resume, and no generator state to save."""
        generator = torch.Generator(self.device).manual_seed(hash((self.cfg.seed, *seed)) % 2**63)
        return dflash.sample_anchors(batch.loss_mask, batch.documents, self.cfg.block_size, self.cfg.num_anchors,
                                     generator)

    def denominators(self, batches: list[Batch], anchors: list) -> torch.Tensor:
        """The loss's normaliser over the global batch: per TTT step, or DFlash's summed label weights."""
        if self.dflash:
            return sum(dflash.block_weights(a, b.loss_mask, self.cfg.block_size, self.cfg.loss_gamma).sum()
                       for a, b in zip(anchors, batches)).float()
        return sum(step_masks(b.loss_mask, self.cfg.ttt_steps, b.documents).sum(dim=(1, 2)) for b in batches).float()

    def forward(self, batch: Batch, denominators: torch.Tensor | None, anchors=None) -> TTTOutput:
        if self.cfg.cuda_graphs:  # the graphs' outputs of the last forward are consumed: their memory may be reused
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.dflash:
                return self.model(batch.aux, batch.input_ids, batch.loss_mask, self.target_embed, self.target_head,
                                  anchors, self.cfg.loss_gamma, denominators, batch.documents)
            return self.model(batch.aux, batch.input_ids, batch.loss_mask, batch.last, self.target_head,
                              self.cfg.ttt_steps, self.cfg.step_loss_decay, denominators, batch.target_argmax,
                              batch.documents, self.head_rows)

    def plan(self, train: bool, epoch: int) -> list:
        """An epoch's micro-batches (a pure function of seed and epoch): packed, lists of rows of segments;
        unpacked, lists of sample indices. The eval plan is fixed (seed 0, epoch 0). The last one computed is
        kept (a step asks for its epoch's plan, which took 5 ms over 7,000 conversations and 38 ms over 46,000
        on the 2-core CPU); a following run's plan changes as shards land, so the key holds the sample count."""
        documents = self.split.documents(train, self.cfg.pack)
        key = (train, epoch, len(documents))
        if self.plan_cache[0] != key:
            plan = epoch_plan(documents, self.data.lengths, self.cfg.batch_tokens, self.pack_shape,
                              self.cfg.seed if train else 0, epoch)
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
        if self.feed:
            self.feed.await_micro_batches((step + 1) * self.per_step)
            if step < self.feed.epoch0_steps:
                return rank_micro_batches(self.feed.epoch0, step, self.world, self.cfg.grad_accum, self.rank)
            epoch, offset = divmod(step - self.feed.epoch0_steps, self.steps_per_epoch)
            epoch += 1
        else:
            epoch, offset = divmod(step, self.steps_per_epoch)
        return rank_micro_batches(self.plan(train=True, epoch=epoch), offset, self.world, self.cfg.grad_accum,
                                  self.rank)

    def train_step(self) -> dict:
        """One optimizer step, waited for: its record (benchmarks and tests; the loop uses `launch_step`)."""
        return self.launch_step().resolve()

    def launch_step(self) -> "PendingStep":
        """Queue one optimizer step on the device and return without waiting for it: the loop resolves a step's
        record after it has queued the next one, so the host prepares step n+1 while the GPU runs step n."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.total_steps, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plan, batches = self.step_batches(self.step)
        # Global denominators: supervised positions per TTT step over the whole global batch. One micro-batch in
        # one process is the whole global batch: the forward counts them itself (the same numbers), inside the
        # compiled region with --compile, instead of some 50 eager kernels here.
        denom = None
        anchors = ([self.anchors(b, (self.step, self.rank, i)) for i, b in enumerate(batches)] if self.dflash
                   else [None] * len(batches))
        if self.world > 1 or len(batches) > 1:
            denom = self.denominators(batches, anchors)
        if self.world > 1:
            dist.all_reduce(denom)
        self.optimizer.zero_grad(set_to_none=True)
        sums = None  # [loss, loss_sum (K), correct (K), count (K)] summed over the micro-batches
        for i, (batch, blocks) in enumerate(zip(batches, anchors)):
            out = self.forward(batch, denom, blocks)
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
            part = torch.cat([out.loss.detach().view(1), out.loss_sum, out.correct_count, out.count,
                              *self.block_acceptance(out)]).float()
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
        return PendingStep(step=self.step + 1, ttt_steps=self.positions, lr=lr, t0=t0, stats=stats,
                           tokens=sum(int(b.loss_mask.numel()) for b in batches) * self.world,
                           shape=list(batches[0].input_ids.shape))

    def block_acceptance(self, out: TTTOutput) -> list[torch.Tensor]:
        """DFlash: [sum of 1 + leading correct positions, blocks] of a forward's blocks (on the device); EAGLE-3: []."""
        if not self.dflash:
            return []
        run = (out.correct & out.valid).long().cumprod(dim=0).sum(dim=0)  # (B, A)
        blocks = out.valid[0]
        return [((run + 1) * blocks).sum().view(1), blocks.sum().view(1)]

    # -- evaluation -----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        """Teacher-forced per-step accuracy and simulated acceptance on the held-back samples (DFlash: per block
        position, and tau[k] the expected accepted length of a block drafting k tokens; its blocks are fixed by
        seed, so every evaluation scores the same ones)."""
        K = self.positions
        correct, count, loss, n = torch.zeros(K), torch.zeros(K), 0.0, 0
        walk = {k: [0.0, 0] for k in range(1, K + 1)}
        every = {k: [0.0, 0] for k in range(1, K + 1)}
        for i, mb in enumerate(self.plan(train=False, epoch=0)):
            batch = self.load(mb)
            out = self.forward(batch, None, self.anchors(batch, (-1, self.rank, i)) if self.dflash else None)
            correct += out.correct_count.cpu()
            count += out.count.cpu()
            loss += float(out.loss)
            n += 1
            for k in range(1, K + 1):
                walker = simulated_acceptance if self.dflash else engine_walk_acceptance  # DFlash: chains are blocks
                for sums, fn in ((walk, walker), (every, simulated_acceptance)):
                    s, c = fn(out.correct, out.valid, k)
                    sums[k][0] += s
                    sums[k][1] += c
        return EvalResult(acc=(correct / count.clamp(min=1)).tolist(),  # tau: only where a chain was measured
                          tau={k: s / c for k, (s, c) in walk.items() if c}, loss=loss / max(n, 1),
                          tau_all_starts={k: s / c for k, (s, c) in every.items() if c})

    # -- checkpoints ----------------------------------------------------------------------------------

    def save(self, name: str) -> Path:
        """Checkpoint OUT/checkpoints/NAME (rank 0 writes it); with --delete-consumed then delete the shards no
        later step reads."""
        path = self.out / "checkpoints" / name
        self.saved_at = self.step
        model_state, optim_state = full_states(self.drafter, self.optimizer, self.fsdp)
        if self.rank == 0:
            write_checkpoint(path, self.drafter, self.step, model_state, optim_state, self.fsdp,
                             extra={"store": self.cfg.store, "target": self.data.target_name})
        if self.world > 1:
            dist.barrier()
        if self.cfg.delete_consumed and (gone := self.feed.delete_trained(self.step)):
            self.log({"step": self.step, "deleted_shards": gone})
        return path

    def try_resume(self) -> bool:
        """Continue from the run's latest checkpoint, if it has one: weights, optimizer, RNG, step."""
        path = latest_checkpoint(self.out)
        if path is None:
            return False
        self.step = self.saved_at = restore(path, self.drafter, self.optimizer, self.fsdp, self.data.embed_tokens())
        if self.rank == 0:
            drop_rows_after(self.out / "metrics.jsonl", self.step)
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

    def run(self, progress: bool = True) -> EvalResult:
        check_settings(self.cfg, self.world)  # the record below must not claim settings another run's weights lack
        if self.rank == 0:  # one process writes a run folder, from its first write to its end (torchrun: rank 0)
            hold(self.out, "train")
            mark(self.out, "train")
        if self.world > 1:
            dist.barrier()
        resumed = self.try_resume()
        if self.rank == 0:
            (self.out / RECORD).write_text(json.dumps({**record(self.cfg, self.world), "layout": self.layout._asdict()},
                                                      indent=2) + "\n")
            packing = (f"packed rows of {self.row_tokens} tokens x {self.rows_per_batch} per micro-batch "
                       f"({len(self.split.train_pieces)} documents)" if self.cfg.pack
                       else "unpacked")
            print(f"train: {len(self.split.train_idx)} train / {len(self.split.eval_idx)} eval samples, {packing}, {self.total_steps} "
                  f"steps ({self.steps_per_epoch}/epoch), world {self.world}, device {self.device}, {self.drafter_note()}"
                  + (f", resumed at step {self.step}" if resumed else ""))
        from draftsmith.progress import progress_bar

        start = self.evaluate_start(resumed)
        with progress_bar("train", total=self.total_steps, unit="steps") if self.rank == 0 and progress \
                else _null_bar() as bar:
            if resumed:
                bar.advance(self.step)
            pending: PendingStep | None = None  # the step in flight, reported once the next one is queued
            while self.step < self.stop_step:
                if self.cfg.follow:  # the store may complete here, and with --delete-consumed end the run
                    pending = self.report(pending, bar)  # waiting on the writer must not count as step time
                    self.feed.await_micro_batches((self.step + 1) * self.per_step)
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
        model_state, _ = full_states(self.drafter, self.optimizer, self.fsdp)
        if self.rank == 0:
            result = self.write_drafter(result, start, model_state)
        return result

    def drafter_note(self) -> str:
        """The start line's words on the drafter trained."""
        if self.dflash:
            c = self.drafter.config
            return (f"DFlash drafter: {c.num_layers} layers, block {c.block_size}, mask token {c.mask_token_id}, target "
                    f"layers {list(c.aux_layer_ids)} (boundary ids), {self.cfg.num_anchors} anchors per row")
        return (f"draft head {'from --init-from' if self.cfg.init_from else self.layout.head_init}"
                f"{'' if self.layout.train_head else ', frozen'}, "
                f"{layout_note(self.layout, self.cfg.init_from, self.cfg.recipe)}")

    def evaluate_start(self, resumed: bool) -> EvalResult | None:
        """With --init-from and --keep-start: the starting drafter on the held-back samples, before the first step
        (a resumed run reads it back from metrics.jsonl). None when there is nothing to compare against."""
        if not (self.cfg.init_from and self.cfg.keep_start) or self.cfg.follow or not self.split.eval_idx:
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
        K = self.positions
        if start is None or result.tau[K] > start.tau[K]:
            if start is not None:
                extra["selection"] = selection("fine-tuned", start, result, K)
            save_drafter(self.drafter, self.out / "drafter", extra={**extra, "eval": asdict(result)}, state=model_state)
            return result
        print(f"train: fine-tuning did not raise held-back simulated tau at k={K} ({start.tau[K]:.2f} -> "
              f"{result.tau[K]:.2f}): {self.out / 'drafter'} is the starting drafter ({self.cfg.init_from}) unchanged; "
              "--no-keep-start (run: train.keep_start=false) writes the fine-tuned one", flush=True)
        starting = self.new_dflash() if self.dflash else load_starting_drafter(self.data, self.cfg)  # grown as this run started it, when --draft-vocab-size grew it
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
        if not self.split.eval_idx:
            return
        self.log({"step": self.step, "eval": asdict(result)})
        if self.rank == 0:
            taus = " ".join(f"{k}:{v:.2f}" for k, v in result.tau.items())
            print(f"eval  {self.step:05d} | loss {result.loss:.3f} | acc {' '.join(f'{a:.2f}' for a in result.acc)} "
                  f"| {'expected block acceptance' if self.dflash else 'simulated'} tau[k] "
                  f"{'' if self.dflash else '(engine walk) '}{taus}", flush=True)


class _null_bar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, *args, **kwargs):
        pass


def drop_rows_after(metrics: Path, step: int) -> None:
    """Drop the rows a killed run logged after its last checkpoint (the resumed run logs those steps again), so
    each step has one row. Rows without a step (the start eval) stay."""
    if not metrics.is_file():
        return
    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except json.JSONDecodeError:  # the row a kill cut in half
            return False

    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    keep = [ln for ln in lines if kept(ln)]
    if len(keep) < len(lines):
        tmp = metrics.with_name(metrics.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(metrics)


def step_line(r: dict, total: int) -> str:
    """The one greppable line per step (docs/design.md, "Measured output")."""
    acc = " ".join(f"{a:.2f}" for a in r["acc"])
    block = f" | block tau {r['block_tau']:.2f}" if "block_tau" in r else ""
    return (f"step {r['step']:05d}/{total:05d} | loss {r['loss']:.3f} | acc[k] {acc}{block} | lr {r['lr']:.2e} "
            f"| {r['ms']:.0f} ms | {r['tok_per_s']:,.0f} tok/s" + (" (first step: compile / warm-up)" if r.get("first_step") else ""))

