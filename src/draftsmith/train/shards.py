"""Follow a feature store that is still being written: verified shards, in order, as the writer commits them.

`ShardFeed` is `train --follow`'s side of it: epoch 0 grows shard by shard as the writer lands them (each
shuffled and packed on its own, from the lengths its manifest entry lists), ends when the writer marks the store
complete, and with --delete-consumed each shard is deleted once every step that reads it is checkpointed.

The writer (`store.StoreWriter`, used by both captures) renames a shard into place and then rewrites the
manifest atomically, so a shard the manifest lists is complete. `follow_shards` polls the manifest,
verifies each new shard's sha256 and its states (`sanity.check_states`) before yielding it, stops once
the manifest says `complete`, and can delete each shard once the consumer asks for the next one, so
that capture on one node feeds a consumer on another through bounded disk.

    for index, samples in follow_shards(Path("store"), delete_consumed=True):
        ...  # train on samples
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from safetensors import safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.capture.sanity import check_states
from draftsmith.capture.store import MANIFEST, SHARD_TENSORS, Sample, corrupt_shard, load_manifest, sha256_file
from draftsmith.train.features import Segment, StoreSource
from draftsmith.train.packing import Split, epoch_plan, split_indices, split_samples
from draftsmith.train.settings import TrainConfig


def read_manifest(root: Path) -> dict | None:
    """The store's checked manifest (`store.load_manifest`), or None before a writer has published one."""
    return load_manifest(root) if (root / MANIFEST).is_file() else None


def shard_samples(path: Path) -> list[Sample]:
    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets")
        tensors = {name: f.get_tensor(name) for name in SHARD_TENSORS}
    return [Sample(*(tensors[n][int(a):int(b)] for n in SHARD_TENSORS)) for a, b in zip(offsets[:-1], offsets[1:])]


def verified_shard(root: Path, entry: dict, first_sample: int) -> list[Sample]:
    """The shard's samples after its sha256 and its states are checked."""
    path = root / entry["file"]
    if sha256_file(path) != entry["sha256"]:
        raise corrupt_shard(root, entry)
    return sane_shard(root, entry, first_sample)


def sane_shard(root: Path, entry: dict, first_sample: int) -> list[Sample]:
    """The shard's samples after `sanity.check_states` (all-zero, constant, non-finite states stop here)."""
    samples = shard_samples(root / entry["file"])
    for j, s in enumerate(samples):
        check_states(s, first_sample + j, where=entry["file"])
    return samples


def wait_published(root: Path, timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until a writer has published the store's manifest and target head (`StoreWriter.publish`).

    Raises:
        DraftsmithError: nothing was published within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while not ((m := read_manifest(Path(root))) and "target_head_sha256" in m):
        if time.monotonic() > deadline:
            raise DraftsmithError("no feature store to follow", got=f"{root}: no published manifest and target head "
                                  f"after {timeout_s:.0f} s", expected="a `draftsmith capture --out` writing there",
                                  fix="start the capture first (or together), or check --store")
        time.sleep(poll_s)


def follow_shards(root: Path, start: int = 0, poll_s: float = 1.0, idle_timeout_s: float = 3600.0,
                  delete_consumed: bool = False) -> Iterator[tuple[int, list[Sample]]]:
    """Yield (shard index, samples) from shard `start` on, waiting for new ones until the store is complete.

    Args:
        start: the first shard to yield (a consumer resuming after shard start-1).
        idle_timeout_s: give up when the manifest has not grown for this long.
        delete_consumed: delete a shard's file once the next one is asked for (or the loop ends).
    Raises:
        DraftsmithError: a shard fails verification, or the writer stopped without finishing.
    """
    root = Path(root)
    index, first_sample = start, None
    last_growth = time.monotonic()
    while True:
        manifest = read_manifest(root)
        shards = manifest["shards"] if manifest else []
        if first_sample is None and manifest:
            first_sample = sum(s["num_samples"] for s in shards[:start])
        if index < len(shards):
            entry = shards[index]
            samples = verified_shard(root, entry, first_sample)
            yield index, samples
            if delete_consumed:
                (root / entry["file"]).unlink(missing_ok=True)
            first_sample += entry["num_samples"]
            index, last_growth = index + 1, time.monotonic()
            continue
        if manifest and manifest.get("complete"):
            return
        if time.monotonic() - last_growth > idle_timeout_s:
            raise DraftsmithError("the feature store stopped growing before it was complete",
                                  got=f"{len(shards)} shards, no new one for {idle_timeout_s:.0f} s",
                                  expected="new shards, or the writer's manifest marked complete",
                                  fix="check the capture; rerun it (it resumes) and follow again from this shard")
        time.sleep(poll_s)


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


class ShardFeed:
    """--follow: a store still being written, as the run's split and epoch 0 (`land` takes in what the writer
    committed); with --delete-consumed, `delete_trained` deletes what no later step reads.

    `epoch0_steps` and `steps_per_epoch` (of the whole-store epochs 1, 2, ...) are inf until the writer marks the
    store complete. The packed shape is the configured one (no shrink: the store's size is not known).
    """

    def __init__(self, data: StoreSource, cfg: TrainConfig, out: Path, shape: tuple[int, int] | None, world: int,
                 rank: int):
        """`shape`: (row tokens, rows per micro-batch), None unpacked. Lands the shards already written."""
        self.data, self.cfg, self.out, self.shape = data, cfg, out, shape
        self.world, self.rank, self.per_step = world, rank, world * cfg.grad_accum
        self.split = Split()
        self.epoch0: list = []  # epoch 0's micro-batches: the landed shards' plans one after the other
        self.landed, self.first_sample = 0, 0
        self.shard_ranges: list[tuple[int, int]] = []  # shard i's micro-batches: epoch0[a:b]
        self.shard_first: list[int] = []  # shard i's first global sample index
        self.deleted: set[int] = set()
        self.epoch0_steps = self.steps_per_epoch = math.inf  # until the writer marks the store complete
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
            self.split.train_idx += plan.train
            self.split.eval_idx += plan.held
            self.split.train_pieces += plan.train_pieces
            self.split.eval_pieces += plan.eval_pieces
            self.epoch0 += plan.micro_batches
            self.first_sample += shards[i]["num_samples"]
        new, self.landed = len(shards) - self.landed, len(shards)
        if store.complete and self.epoch0_steps == math.inf:
            self.finish()
        return new

    def plan_shard(self, i: int) -> ShardPlan:
        """Shard i checked (sha256, `sanity`) and split into train / eval, its training share shuffled (and packed)
        on its own; with --delete-consumed, rank 0 keeps the plan and the held-back samples in OUT/consumed/."""
        store = self.data.store
        store.verify_shard(i)
        sane_shard(store.root, store.manifest["shards"][i], self.first_sample)
        tr, ev = split_indices(store.manifest["shards"][i]["num_samples"], self.cfg.eval_fraction)
        train, held = [self.first_sample + j for j in tr], [self.first_sample + j for j in ev]
        split = split_samples(train, held, self.data.lengths, self.shape[0] if self.shape else None,
                              self.cfg.pack_long, self.data.loss_mask)
        mbs = epoch_plan(split.documents(train=True, packed=self.cfg.pack), self.data.lengths, self.cfg.batch_tokens,
                         self.shape, self.cfg.seed, FOLLOW_SHARD_EPOCH + i)
        plan = ShardPlan(train, held, mbs, split.train_pieces, split.eval_pieces)
        if self.cfg.delete_consumed and self.rank == 0:
            self.keep_consumed(i, plan)
        return plan

    def finish(self) -> None:
        """The store is complete: epoch 0's length, and that of the whole-store epochs after it."""
        if not self.epoch0:
            raise DraftsmithError("nothing to train on", got=f"a complete store of {len(self.data)} samples",
                                  expected="samples with supervised tokens", fix="check the capture's conversations")
        self.epoch0_steps = -(-len(self.epoch0) // self.per_step)  # the last step wraps to the epoch's start
        whole = epoch_plan(self.split.documents(train=True, packed=self.cfg.pack), self.data.lengths,
                           self.cfg.batch_tokens, self.shape, self.cfg.seed, 1)
        self.steps_per_epoch = max(1, len(whole) // self.per_step)
        if self.rank == 0:
            print(f"train: the store is complete: epoch 0 was {self.epoch0_steps} steps over "
                  f"{len(self.split.train_idx)} train samples; later epochs {self.steps_per_epoch} steps", flush=True)

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

    # -- --delete-consumed: what a deleted shard leaves behind, and when it goes -------------------------

    def plan_settings(self) -> dict:
        """The settings a shard's plan depends on (a resume must use the same)."""
        row_tokens, rows_per_batch = self.shape or (None, None)
        return {"seed": self.cfg.seed, "pack": self.cfg.pack, "batch_tokens": self.cfg.batch_tokens,
                "row_tokens": row_tokens, "pack_long": self.cfg.pack_long, "rows_per_batch": rows_per_batch,
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

    def delete_trained(self, step: int) -> list[str]:
        """After a checkpoint at step S: delete each shard no step after S reads (its micro-batches all lie in
        the first S steps; a shard holding one of epoch 0's first world*grad_accum - 1 micro-batches waits
        for epoch 0's end, whose last step wraps to them). A resume from this checkpoint never needs them.
        Returns the deleted shards' files."""
        done, over = step * self.per_step, step >= self.epoch0_steps
        gone = [i for i, (a, b) in enumerate(self.shard_ranges) if i not in self.deleted and b <= done
                and (over or a == b or a >= self.per_step - 1)]
        if self.world > 1:  # rank 0 decides (ranks may differ in what they have landed); all close the files
            box = [gone]
            dist.broadcast_object_list(box, src=0)
            gone = box[0]
            if gone and self.landed <= max(gone):
                self.land()
        store = self.data.store
        for i in gone:
            held = [k - self.shard_first[i] for k in self.split.eval_idx
                    if self.shard_first[i] <= k < self.shard_first[i] + store.manifest["shards"][i]["num_samples"]]
            store.set_aside(i, held, self.consumed_path(i, ".safetensors") if held else None)
            if self.rank == 0:
                (store.root / store.manifest["shards"][i]["file"]).unlink(missing_ok=True)
            self.deleted.add(i)
        return [store.manifest["shards"][i]["file"] for i in gone]

