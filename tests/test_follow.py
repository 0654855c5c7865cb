"""Following a store that is still being written: every shard once, in order, verified; deletion bounds disk."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.train.shards import follow_shards
from draftsmith.capture.store import Sample, StoreWriter


def sample(i: int, T: int = 5, H: int = 8) -> Sample:
    g = torch.Generator().manual_seed(i)
    return Sample(torch.full((T,), i), torch.ones(T, dtype=torch.long), torch.randn(T, 3 * H, generator=g),
                  torch.randn(T, H, generator=g), torch.zeros(T, dtype=torch.long))


def slow_writer(root, n: int, delay_s: float, finish: bool = True) -> threading.Thread:
    def write():
        w = StoreWriter(root, {"test": 1}, shard_tokens=5)  # one sample per shard
        for i in range(n):
            w.add(sample(i))
            time.sleep(delay_s)
        if finish:
            w.finish(torch.zeros(4, dtype=torch.long), {"lm_head": torch.zeros(4, 8)}, {})
    t = threading.Thread(target=write)
    t.start()
    return t


def test_follower_sees_every_shard_once_in_order_and_stops_when_complete(tmp_path):
    writer = slow_writer(tmp_path, 6, 0.1)
    seen, on_disk = [], []
    for index, samples in follow_shards(tmp_path, poll_s=0.02, delete_consumed=True):
        seen.append((index, int(samples[0].input_ids[0])))
        on_disk.append(len(list(tmp_path.glob("shard-*.safetensors"))))
    writer.join()
    assert seen == [(i, i) for i in range(6)]
    assert not list(tmp_path.glob("shard-*.safetensors")), "consumed shards are deleted"
    assert max(on_disk) <= 2, f"at most the shard in use and one landed meanwhile, got {on_disk}"


def test_follower_resumes_from_a_shard_and_refuses_a_stalled_writer(tmp_path):
    slow_writer(tmp_path, 4, 0.0, finish=False).join()
    got = []
    with pytest.raises(DraftsmithError, match="stopped growing"):
        for index, _ in follow_shards(tmp_path, start=2, poll_s=0.02, idle_timeout_s=0.3):
            got.append(index)
    assert got == [2, 3]


def test_back_pressure_holds_a_fast_capture_to_its_byte_budget_while_a_follower_deletes(tmp_path):
    """The writer never puts more than max_store_bytes of shards on disk: it waits until the follower deletes."""
    one = len(sample(0).input_ids) * (4 * 8 * 2 + 4 + 1 + 4)  # the estimate of one one-sample shard
    limit = 2 * one + one // 2  # room for two shards, not three
    peak = []

    def write():
        w = StoreWriter(tmp_path, {"test": 1}, shard_tokens=5, max_store_bytes=limit, room_timeout_s=30)
        for i in range(6):
            w.add(sample(i))  # no delay: the writer is faster than the follower
            peak.append(w.shard_bytes_on_disk())
        w.finish(torch.zeros(4, dtype=torch.long), {"lm_head": torch.zeros(4, 8)}, {})
    t = threading.Thread(target=write)
    t.start()
    seen = []
    for index, _ in follow_shards(tmp_path, poll_s=0.02, delete_consumed=True):
        time.sleep(0.1)  # a slow trainer
        seen.append(index)
    t.join()
    assert seen == list(range(6))
    # each file is the estimate plus its safetensors header: at most two shards' worth ever on disk
    assert max(peak) <= 2 * one + 2 * 1024, peak
    assert len(peak) == 6


def test_back_pressure_without_a_follower_stops_with_the_reason(tmp_path):
    one = len(sample(0).input_ids) * (4 * 8 * 2 + 4 + 1 + 4)
    w = StoreWriter(tmp_path, {"test": 1}, shard_tokens=5, max_store_bytes=2 * one, room_timeout_s=0.3)
    w.add(sample(0))
    with pytest.raises(DraftsmithError, match="stayed full") as err:
        for i in range(1, 4):
            w.add(sample(i))
    assert "--delete-consumed" in err.value.fix
    assert len(w.manifest["shards"]) >= 1  # what was written stays valid: a rerun resumes from it
    with pytest.raises(DraftsmithError, match="larger than --max-store-bytes"):
        StoreWriter(tmp_path / "tiny", {"test": 1}, shard_tokens=5, max_store_bytes=10).add(sample(0))
