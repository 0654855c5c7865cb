"""Following a store that is still being written: every shard once, in order, verified; deletion bounds disk."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.follow import follow_shards
from draftsmith.store import Sample, StoreWriter


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
