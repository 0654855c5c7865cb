"""`train --follow`: training on a store while its writer still adds shards (epoch 0 follows the writer)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from conftest import write_conversations
from draftsmith.capture import capture
from draftsmith.errors import DraftsmithError
from draftsmith.store import FeatureStore, StoreWriter
from draftsmith.train import TrainConfig, Trainer

PER_SHARD = 3


@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory) -> FeatureStore:
    root = tmp_path_factory.mktemp("follow_ref")
    conv = write_conversations(root / "conv.jsonl", n=16)
    capture(conv, root / "store", target=str(tiny_target), shard_tokens=300)
    return FeatureStore(root / "store")


def replay(reference: FeatureStore, root: Path, delay_s: float) -> threading.Thread:
    """A writer thread re-writing `reference` into `root`, PER_SHARD samples a shard, `delay_s` apart, as a
    running capture would: head and token counts published first, complete only at the end."""
    def write():
        w = StoreWriter(root, reference.identity, shard_tokens=10**9)
        counts, head = reference.token_counts(), reference.target_tensors()
        w.publish(counts, head)
        for k in range(len(reference)):
            w.add(reference.sample(k))
            if (k + 1) % PER_SHARD == 0:
                w.flush()
                time.sleep(delay_s)
        w.finish(counts, head, {})
    t = threading.Thread(target=write)
    t.start()
    return t


def follow_config(store: Path, out: Path, max_steps: int, **kw) -> TrainConfig:
    # by default --no-pack with a 1-token budget: one sample per micro-batch, so a step is a sample
    settings = {"pack": False, "batch_tokens": 1, "eval_fraction": 0.34, "draft_vocab_size": 128, "ttt_steps": 3,
                "lr": 3e-3, "eval_every": 10**6, "save_every": 10**6, "log_every": 10**6, "follow_timeout_s": 60}
    return TrainConfig(out=str(out), store=str(store), follow=True, max_steps=max_steps, **{**settings, **kw})


def test_epoch_0_follows_the_writer_and_trains_on_every_sample_once(reference, tmp_path):
    n = len(reference)
    shard_sizes = [min(PER_SHARD, n - a) for a in range(0, n, PER_SHARD)]
    n_train = sum(s - (1 if s > 1 else 0) for s in shard_sizes)  # a 0.34 eval share holds back one of three
    writer = replay(reference, tmp_path / "store", delay_s=0.4)
    trainer = Trainer(follow_config(tmp_path / "store", tmp_path / "run", max_steps=n_train + 2))
    steps: list[tuple[int, list, bool]] = []
    plan_step = trainer.micro_batches_for

    def recording(step):
        mbs = plan_step(step)
        steps.append((step, mbs, trainer.data.store.complete))
        return mbs
    trainer.micro_batches_for = recording
    trainer.run(progress=False)
    writer.join()
    assert not steps[0][2], "the writer finished before training started; the test proves nothing"
    assert trainer.epoch0_steps == n_train
    epoch0 = [k for _, mbs, _ in steps[:n_train] for mb in mbs for k in mb]
    assert sorted(epoch0) == sorted(trainer.train_idx) and len(set(epoch0)) == n_train, \
        f"epoch 0 should hold every training sample exactly once, got {epoch0}"
    assert sorted(trainer.train_idx + trainer.eval_idx) == list(range(n)), "train and eval split every sample once"
    later = [mbs for _, mbs, _ in steps[n_train:]]
    assert later == [[mb] for mb in trainer.plan(train=True, epoch=1)[:2]], "epoch 1 is the whole-store shuffle"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "eval" not in r] == list(range(1, n_train + 3))
    # the plan depends on the shards, not on when they landed: a run resumed later (or started on the complete
    # store) has the same epoch 0, which is what makes a resume exact
    again = Trainer(follow_config(tmp_path / "store", tmp_path / "again", max_steps=n_train + 2))
    assert (again.epoch0, again.train_idx, again.eval_idx) == (trainer.epoch0, trainer.train_idx, trainer.eval_idx)


def test_packed_epoch_0_places_every_training_piece_once_in_micro_batches_of_one_shape(reference, tmp_path):
    replay(reference, tmp_path / "store", delay_s=0.0).join()
    trainer = Trainer(follow_config(tmp_path / "store", tmp_path / "run", max_steps=1, pack=True, batch_tokens=256,
                                    row_tokens=64))
    placed = [piece for mb in trainer.epoch0 for row in mb for piece in row]
    assert sorted(placed) == sorted(trainer.train_pieces) and len(set(placed)) == len(placed), \
        "every training piece of every shard exactly once in epoch 0"
    assert {k for k, _, _ in placed} == set(trainer.train_idx)
    assert all(len(mb) == trainer.rows_per_batch == 4 for mb in trainer.epoch0), "one micro-batch shape"
    assert all(sum(b - a for _, a, b in row) <= 64 for mb in trainer.epoch0 for row in mb)


def test_follow_needs_a_step_budget_and_a_store(tmp_path):
    with pytest.raises(DraftsmithError, match="--follow needs --store and --max-steps"):
        TrainConfig(out=str(tmp_path), store=str(tmp_path), follow=True)


def test_a_store_that_never_appears_is_named(tmp_path):
    with pytest.raises(DraftsmithError, match="no feature store to follow"):
        Trainer(follow_config(tmp_path / "nothing", tmp_path / "run", max_steps=5, follow_timeout_s=0.5))


def test_a_writer_that_stops_and_a_zeroed_shard_stop_training_with_the_reason(reference, tmp_path):
    w = StoreWriter(tmp_path / "stalled", reference.identity, shard_tokens=10**9)
    w.publish(reference.token_counts(), reference.target_tensors())
    for k in range(2 * PER_SHARD):
        w.add(reference.sample(k))
    w.flush()  # one shard, then the writer goes quiet without marking the store complete
    trainer = Trainer(follow_config(tmp_path / "stalled", tmp_path / "run", max_steps=50, follow_timeout_s=1))
    with pytest.raises(DraftsmithError, match="stopped growing before it was complete"):
        trainer.run(progress=False)

    bad = reference.sample(0)
    w.add(type(bad)(bad.input_ids, bad.loss_mask, bad.aux * 0, bad.last, bad.target_argmax))
    w.flush()  # a second shard whose aux states are all zero (vllm#46301's failure)
    with pytest.raises(DraftsmithError, match="all zero"):
        Trainer(follow_config(tmp_path / "stalled", tmp_path / "run2", max_steps=50, follow_timeout_s=1))
