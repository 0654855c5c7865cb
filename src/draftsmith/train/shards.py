"""Follow a feature store that is still being written: verified shards, in order, as the writer commits them.

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
import time
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.capture.sanity import check_states
from draftsmith.capture.store import MANIFEST, SHARD_TENSORS, Sample, sha256_file


def read_manifest(root: Path) -> dict | None:
    path = root / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def shard_samples(path: Path) -> list[Sample]:
    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets")
        tensors = {name: f.get_tensor(name) for name in SHARD_TENSORS}
    return [Sample(*(tensors[n][int(a):int(b)] for n in SHARD_TENSORS)) for a, b in zip(offsets[:-1], offsets[1:])]


def verified_shard(root: Path, entry: dict, first_sample: int) -> list[Sample]:
    """The shard's samples after its sha256 and its states are checked."""
    path = root / entry["file"]
    if sha256_file(path) != entry["sha256"]:
        raise DraftsmithError(f"corrupt feature-store shard {entry['file']}", got="sha256 mismatch",
                              expected=f"sha256 {entry['sha256'][:16]}...", fix="recapture into a new store")
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
