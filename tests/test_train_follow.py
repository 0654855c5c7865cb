"""`train --follow`: training on a store while its writer still adds shards (epoch 0 follows the writer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import write_conversations
from draftsmith.capture.local import capture
from draftsmith.errors import DraftsmithError
from draftsmith.capture.store import FeatureStore, StoreWriter
from draftsmith.train.settings import TrainConfig
from draftsmith.train.trainer import Trainer

PER_SHARD = 3


@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory) -> FeatureStore:
    root = tmp_path_factory.mktemp("follow_ref")
    conv = write_conversations(root / "conv.jsonl", n=16)
    capture(conv, root / "store", target=str(tiny_target), shard_tokens=300)
    return FeatureStore(root / "store")


def replay(reference: FeatureStore, root: Path, delay_s: float = 0.0, cap: int | None = None,
           manifests: list[str] | None = None, wait_s: float = 30.0) -> threading.Thread:
    """A writer thread re-writing `reference` into `root`, PER_SHARD samples a shard, `delay_s` apart, as a
    running capture would: head and token counts published first, complete only at the end.

    With `cap`: a writer on a disk that holds `cap` shards. Before each new shard it waits (up to `wait_s`) until
    fewer than `cap` shard files are on disk, and gives up otherwise. Each manifest it wrote goes to `manifests`."""
    def room() -> bool:
        deadline = time.monotonic() + wait_s
        while cap is not None and len(shard_files(root)) >= cap:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def write():
        w = StoreWriter(root, reference.identity, shard_tokens=10**9)
        counts, head = reference.token_counts(), reference.target_tensors()
        w.publish(counts, head)
        for k in range(len(reference)):
            w.add(reference.sample(k))
            if (k + 1) % PER_SHARD == 0 or (cap is not None and k == len(reference) - 1):
                if not room():
                    return  # the disk stayed full: the writer stops without finishing
                w.flush()
                if manifests is not None:
                    manifests.append((root / "manifest.json").read_text())
                time.sleep(delay_s)
        w.finish(counts, head, {})
        if manifests is not None:
            manifests.append((root / "manifest.json").read_text())
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
    assert trainer.feed.epoch0_steps == n_train
    epoch0 = [k for _, mbs, _ in steps[:n_train] for mb in mbs for k in mb]
    assert sorted(epoch0) == sorted(trainer.split.train_idx) and len(set(epoch0)) == n_train, \
        f"epoch 0 should hold every training sample exactly once, got {epoch0}"
    assert sorted(trainer.split.train_idx + trainer.split.eval_idx) == list(range(n)), "train and eval split every sample once"
    later = [mbs for _, mbs, _ in steps[n_train:]]
    assert later == [[mb] for mb in trainer.plan(train=True, epoch=1)[:2]], "epoch 1 is the whole-store shuffle"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "eval" not in r] == list(range(1, n_train + 3))
    # the plan depends on the shards, not on when they landed: a run resumed later (or started on the complete
    # store) has the same epoch 0, which is what makes a resume exact
    again = Trainer(follow_config(tmp_path / "store", tmp_path / "again", max_steps=n_train + 2))
    assert (again.feed.epoch0, again.split.train_idx, again.split.eval_idx) == (trainer.feed.epoch0, trainer.split.train_idx, trainer.split.eval_idx)


def test_packed_epoch_0_places_every_training_piece_once_in_micro_batches_of_one_shape(reference, tmp_path):
    replay(reference, tmp_path / "store", delay_s=0.0).join()
    trainer = Trainer(follow_config(tmp_path / "store", tmp_path / "run", max_steps=1, pack=True, batch_tokens=256,
                                    row_tokens=64))
    placed = [piece for mb in trainer.feed.epoch0 for row in mb for piece in row]
    assert sorted(placed) == sorted(trainer.split.train_pieces) and len(set(placed)) == len(placed), \
        "every training piece of every shard exactly once in epoch 0"
    assert {k for k, _, _ in placed} == set(trainer.split.train_idx)
    assert all(len(mb) == trainer.rows_per_batch == 4 for mb in trainer.feed.epoch0), "one micro-batch shape"
    assert all(sum(b - a for _, a, b in row) <= 64 for mb in trainer.feed.epoch0 for row in mb)


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


# -- --delete-consumed: bounded disk ------------------------------------------------------------------------

def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("shard-*.safetensors"))


def test_delete_consumed_trains_through_a_disk_of_two_shards_and_leaves_a_valid_manifest(reference, tmp_path):
    """A writer that can keep only 2 shards on disk: deleting consumed shards is what lets it finish. Without
    --delete-consumed the same writer stalls and training stops with the reason."""
    store, manifests = tmp_path / "store", []
    writer = replay(reference, store, cap=2, manifests=manifests)
    trainer = Trainer(follow_config(store, tmp_path / "run", max_steps=100, delete_consumed=True, save_every=2,
                                    eval_every=3))
    peak, plan_step = [], trainer.micro_batches_for

    def sampling(step):
        peak.append(sum(p.stat().st_size for p in shard_files(store)))
        return plan_step(step)
    trainer.micro_batches_for = sampling
    result = trainer.run(progress=False)
    writer.join()
    n = len(reference)
    n_train = sum(min(PER_SHARD, n - a) - (1 if min(PER_SHARD, n - a) > 1 else 0) for a in range(0, n, PER_SHARD))
    assert trainer.feed.epoch0_steps == n_train and trainer.step == n_train, "one pass: ends with epoch 0, not --max-steps"
    assert sorted(trainer.split.train_idx + trainer.split.eval_idx) == list(range(n))
    assert shard_files(store) == [], "every consumed shard is deleted"
    maps = Path("/proc/self/maps").read_text()
    assert f"{store}/shard-" not in maps, "no deleted shard is still memory-mapped (its disk would not be freed)"
    written = sum(json.loads(manifests[-1])["shards"][i]["num_tokens"] for i in range(len(trainer.feed.shard_ranges)))
    assert max(peak) < written * reference.hidden_size * 8 / 2, "the store never held half of what was written"
    # the manifest is the writer's, byte for byte: complete, every shard listed with its sha256
    assert (store / "manifest.json").read_text() == manifests[-1]
    manifest = json.loads(manifests[-1])
    assert manifest["complete"] and manifest["num_samples"] == n and len(manifest["shards"]) == len(trainer.feed.shard_ranges)
    assert [json.loads((tmp_path / "run" / "consumed" / f"shard-{i:05d}.json").read_text())["shard_sha256"]
            for i in range(len(manifest["shards"]))] == [s["sha256"] for s in manifest["shards"]]
    assert result.tau[1] >= 1.0 and trainer.split.eval_idx, "evaluation ran on the held-back copies"
    deleted = [r for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "deleted_shards" in (r := json.loads(line))]
    assert [r["step"] for r in deleted][:3] == [2, 4, 6], "a shard goes at the first checkpoint after its last step"
    with pytest.raises(DraftsmithError, match="is missing"):
        FeatureStore(store).verify()
    with pytest.raises(DraftsmithError, match="was deleted, and this run cannot rebuild it"):
        Trainer(follow_config(store, tmp_path / "other_out", max_steps=100, delete_consumed=True))

    stalled, kept = tmp_path / "stalled", []
    writer = replay(reference, stalled, cap=2, manifests=kept, wait_s=3)
    with pytest.raises(DraftsmithError, match="stopped growing before it was complete"):
        Trainer(follow_config(stalled, tmp_path / "run2", max_steps=100, follow_timeout_s=2)).run(progress=False)
    writer.join()


def test_delete_consumed_needs_follow_and_one_epoch(tmp_path):
    with pytest.raises(DraftsmithError, match="reads each shard once"):
        TrainConfig(out=str(tmp_path), store=str(tmp_path), delete_consumed=True)
    with pytest.raises(DraftsmithError, match="reads each shard once"):
        TrainConfig(out=str(tmp_path), store=str(tmp_path), follow=True, max_steps=5, epochs=2, delete_consumed=True)


# -- kill -9 of `train --follow` while the store is written ---------------------------------------------------

@pytest.mark.parametrize("mode", ["follow", "delete-consumed"])
def test_killed_follow_run_resumes_to_the_uninterrupted_result(reference, tmp_path, mode):
    """`train --follow` as a real process on a store being written, kill -9 after a checkpoint, restart it:
    the same loss at every step and the same final weights as a run that was never killed.
    follow: unpacked, one sample a step, into epoch 1. delete-consumed: packed (long samples split at turn
    ends), the shards it trained on are deleted before the kill, so the resume rebuilds them from OUT/consumed/."""
    from safetensors.torch import load_file
    from test_train import CLI, losses

    delete = mode == "delete-consumed"
    flags = ["--lr", "3e-3", "--draft-vocab-size", "128", "--ttt-steps", "3", "--eval-fraction", "0.34",
             "--eval-every", "1000000", "--log-every", "1", "--quiet", "--follow", "--follow-timeout-s", "120"]
    flags += (["--batch-tokens", "128", "--row-tokens", "64", "--save-every", "1", "--max-steps", "50",
               "--delete-consumed"] if delete else ["--no-pack", "--batch-tokens", "1", "--save-every", "2",
                                                    "--max-steps", "13"])

    def train(store: Path, out: Path, **kw):
        return subprocess.Popen([*CLI, "train", "--store", str(store), "--out", str(out), *flags], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    straight_store, straight = tmp_path / "straight_store", tmp_path / "straight"
    replay(reference, straight_store, delay_s=0.0).join()
    out, err = train(straight_store, straight).communicate(timeout=600)
    assert (straight / "drafter").is_dir(), err

    # the writer: three shards, then it waits until the trainer was killed, then the rest
    store, killed, go_on = tmp_path / "store", tmp_path / "killed", threading.Event()
    w = StoreWriter(store, reference.identity, shard_tokens=10**9)
    counts, head = reference.token_counts(), reference.target_tensors()
    w.publish(counts, head)

    def write():
        for k in range(len(reference)):
            if k == 3 * PER_SHARD:
                go_on.wait(600)
            w.add(reference.sample(k))
            if (k + 1) % PER_SHARD == 0:
                w.flush()
        w.finish(counts, head, {})
    writer = threading.Thread(target=write)
    writer.start()
    proc = train(store, killed)
    latest, deadline = killed / "checkpoints" / "latest", time.time() + 300
    while time.time() < deadline and not (latest.exists() and int(latest.read_text().split("-")[1]) >= 2):
        time.sleep(0.02)
    time.sleep(1.0)  # let it reach the end of what has landed
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not FeatureStore(store, follow=True).complete, "the store was complete at the kill; the test proves nothing"
    assert not (killed / "drafter").exists()
    if delete:
        assert len(shard_files(store)) < 3, "no shard was deleted before the kill; the resume rebuilds nothing"
    go_on.set()
    resumed = train(store, killed)
    out, err = resumed.communicate(timeout=600)
    writer.join()
    assert resumed.returncode == 0, err
    assert "resumed at step" in out
    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) and len(a) >= 5
    assert b == a, {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    wa, wb = load_file(straight / "drafter" / "model.safetensors"), load_file(killed / "drafter" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if delete:
        assert shard_files(store) == [] and max(a) == len(a), "one pass over every shard, each then deleted"
        # what the resume rebuilt from OUT/consumed/ is the plan a run on an intact store makes
        intact = tmp_path / "intact"
        replay(reference, intact, delay_s=0.0).join()
        cfg = dict(pack=True, batch_tokens=128, row_tokens=64, eval_fraction=0.34, draft_vocab_size=128, ttt_steps=3)
        rebuilt = Trainer(TrainConfig(out=str(killed), store=str(store), follow=True, max_steps=50,
                                      delete_consumed=True, **cfg))
        fresh = Trainer(TrainConfig(out=str(tmp_path / "fresh"), store=str(intact), follow=True, max_steps=50, **cfg))
        assert (rebuilt.feed.epoch0, rebuilt.split.train_idx, rebuilt.split.eval_idx) == (fresh.feed.epoch0, fresh.split.train_idx, fresh.split.eval_idx)
        placed = [piece for mb in rebuilt.feed.epoch0 for row in mb for piece in row]
        assert sorted(placed) == sorted(rebuilt.split.train_pieces) and len(set(placed)) == len(placed)
        assert any(b - a < reference.sample(k).input_ids.numel() for k, a, b in placed), "no sample was split"
