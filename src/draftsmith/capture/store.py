"""The feature store: captured target hidden states, sharded, verified, resumable, streamable.

Layout of a store directory (docs/design.md, "Contracts between stages"):

    manifest.json                 identity, settings, one entry per complete shard (with sha256)
    shard-00000.safetensors       packed samples: see SHARD_TENSORS
    token_counts.safetensors      int64 [V]: how often each target token is a supervised token
    target_head.safetensors       the frozen target tensors training needs: embed_tokens [V, H], lm_head [V, H]

Per token the store keeps the three aux states and the target's final (post-norm) hidden state, in
bf16: 4 x H x 2 = 8H bytes, plus 4 bytes of token id and 1 of mask. The final hidden state times the
frozen target head gives the target's logits at training time, so the loss uses the target's exact
distribution (over any draft vocabulary chosen later) at a quarter of the aux cost, instead of storing
V logits per token.

Writes are atomic: a shard goes to `*.tmp`, is fsynced and renamed, then the manifest is rewritten the
same way. A writer resumes after the last shard the manifest lists, once it has checked every listed shard
against its sha256 (a shard that does not match is written again, with every shard after it). The token counts and
the target
head are published before the first shard, and each shard's entry lists its samples' lengths and
supervised counts, so a trainer can plan from the manifest while the store is written (`train --follow`). A reader checks each shard's
size on open and its sha256 on `verify()` or on first read (`verify_on_read`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json
from draftsmith.outputs import hold, umask_mode

STORE_VERSION = 2  # 2: shards hold target_argmax
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"
TARGET_HEAD = "target_head.safetensors"
AUX_CONVENTION = "boundary: HF output_hidden_states index (0 = embeddings, b = output of layer b-1)"
# name -> (dtype, per-token width or None for scalars). `offsets` [S+1] marks sample boundaries.
SHARD_TENSORS = {"input_ids": torch.int32, "loss_mask": torch.uint8, "aux": torch.bfloat16, "last": torch.bfloat16,
                 "target_argmax": torch.int32}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `*.tmp`, fsync and rename.

    Raises:
        DraftsmithError: the disk is full or unwritable (`disk_error`; the partial file is removed).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_error(path, exc, len(data)) from exc


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`safetensors.save_file` through `*.tmp`, fsync and rename; a full disk raises `disk_error`. The file is
    readable as the umask says (safetensors writes 0600, which an engine or trainer running as another user of the
    group cannot read)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:  # safetensors reports ENOSPC / EFBIG as SafetensorError
        tmp.unlink(missing_ok=True)
        raise disk_error(path, exc, sum(t.numel() * t.element_size() for t in tensors.values())) from exc


def disk_error(path: Path, exc: Exception, nbytes: int) -> DraftsmithError:
    """The one report of a store file that could not be written (full disk, file-size limit, read-only)."""
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    return DraftsmithError(f"could not write {path.name} in {path.parent}",
                           got=f"{type(exc).__name__}: {exc} ({free:,} bytes free)",
                           expected=f"about {nbytes:,} bytes free for {path.name}",
                           fix="free space (or pick another --out) and rerun the same command: it resumes after "
                           "the last complete shard")


def plain_name(name: object) -> bool:
    """Whether `name` is a file name inside the store's folder: no folder part, no `..`, not absolute."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def load_manifest(root: Path) -> dict[str, Any]:
    """A store's manifest.json, checked: a JSON object whose shard entries each name a file inside the store.

    Raises:
        DraftsmithError: a cut or malformed manifest (file, line, column), or a shard file name that would
            reach outside the store (`..`, an absolute path, a folder).
    """
    path = Path(root) / MANIFEST
    manifest = read_json(path, "feature-store manifest", fix=f"copy the store {root} again whole, or recapture "
                         "into a new --out")
    shards = manifest.get("shards")
    problems = [] if isinstance(shards, list) else [f"shards is {json.dumps(shards)[:60]}, not a list"]
    for i, entry in enumerate(shards if isinstance(shards, list) else []):
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("num_samples"), int) and "file" in entry):
            problems.append(f"shard entry {i} lacks file, sha256 or num_samples")
        elif not plain_name(entry["file"]):
            problems.append(f"shard entry {i} names {entry['file']!r}, outside the store")
        elif not (isinstance(entry.get("lengths"), list) and len(entry["lengths"]) == entry["num_samples"]
                  and sum(entry["lengths"]) == entry.get("num_tokens")):
            problems.append(f"shard entry {i}: its lengths do not add up to its {entry['num_samples']} samples and "
                            f"{entry.get('num_tokens')} tokens")
    problems += counted_totals(manifest, shards if isinstance(shards, list) and not problems else None)
    if problems:
        raise DraftsmithError(f"feature-store manifest {path} is malformed", got="; ".join(problems[:3]),
                              expected="shard entries {file, sha256, num_samples, ...}, each file a name inside the "
                              "store (no folder, no ..)", fix=f"the manifest was edited or comes from elsewhere: copy "
                              f"the store {root} again whole, or recapture into a new --out")
    return manifest


def counted_totals(manifest: dict[str, Any], shards: list[dict] | None) -> list[str]:
    """The manifest's totals are counts, and (with readable shard entries) its samples are its shards' samples."""
    problems = [f"{key} is {json.dumps(manifest.get(key))[:40]}, not a count" for key in ("num_samples", "num_tokens")
                if not (isinstance(manifest.get(key), int) and manifest[key] >= 0)]
    held = None if shards is None or problems else sum(entry["num_samples"] for entry in shards)
    if held is not None and held != manifest["num_samples"]:
        problems.append(f"num_samples {manifest['num_samples']}, but its shards hold {held}")
    return problems


def corrupt_shard(root: Path, entry: dict) -> DraftsmithError:
    """The error for a shard whose bytes do not match its manifest entry, with the fix that works: the writer
    checks every shard when it resumes and recaptures from the first that does not match (`StoreWriter`)."""
    return DraftsmithError(f"corrupt feature-store shard {Path(root) / entry['file']}", got="sha256 mismatch",
                           expected=f"sha256 {entry['sha256'][:16]}... as {MANIFEST} records",
                           fix=f"rerun the `draftsmith capture` command that wrote {root} (same --target, "
                           f"--conversations and --out): it checks every shard and recaptures from {entry['file']} on")


def holds(path: Path, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the safetensors file `path` holds exactly `tensors` (read back and compared bit for bit)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            if set(f.keys()) != set(tensors):
                return False
            for name, want in tensors.items():
                got = f.get_tensor(name)
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want.cpu()):
                    return False
    except (OSError, SafetensorError):
        return False
    return True


def bytes_per_token(hidden_size: int) -> int:
    """Bytes the store keeps per token: 3 aux + 1 final hidden state in bf16, token id, mask, target argmax."""
    return 4 * hidden_size * 2 + 4 + 1 + 4


def bytes_per_sample(sample: "Sample") -> int:
    """About the bytes a sample takes in a shard (the estimate back-pressure plans with)."""
    return len(sample.input_ids) * bytes_per_token(sample.last.shape[-1])


@dataclass
class Sample:
    """One stored sample. Shapes: input_ids, loss_mask, target_argmax (T,); aux (T, 3H); last (T, H)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    target_argmax: torch.Tensor


def write_shard_file(path: Path, samples: list[Sample]) -> tuple[str, int]:
    """Pack samples into one safetensors file atomically; returns (sha256, token count).

    Raises:
        DraftsmithError: the disk is full or unwritable (the partial file is removed).
    """
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "aux": torch.cat([s.aux for s in samples]).to(torch.bfloat16).contiguous(),
        "last": torch.cat([s.last for s in samples]).to(torch.bfloat16).contiguous(),
        "target_argmax": torch.cat([s.target_argmax for s in samples]).to(torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    atomic_save_tensors(path, tensors)
    digest = sha256_file(path)
    return digest, int(lengths.sum())


def identity_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple[str, str]]:
    """The keys (dotted) whose values differ between two store identities, each as (old, new) text."""
    out: dict[str, tuple[str, str]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(identity_changes(a, b, f"{prefix}{key}."))
        elif a != b:
            out[prefix + key] = (json.dumps(a)[:80], json.dumps(b)[:80])
    return out


class StoreWriter:
    """Append samples in shards of about `shard_tokens` tokens; resumes from an existing manifest."""

    def __init__(self, root: Path, identity: dict[str, Any], shard_tokens: int = 1 << 18,
                 max_store_bytes: int | None = None, room_timeout_s: float = 3600.0):
        self.root = Path(root)  # made by the first write: a capture refused before its first shard leaves nothing
        self.shard_tokens = shard_tokens
        self.max_store_bytes, self.room_timeout_s = max_store_bytes, room_timeout_s
        identity = json.loads(json.dumps(identity))  # compare as stored: tuples become lists
        path = self.root / MANIFEST
        if path.exists():
            self.manifest = load_manifest(self.root)
            if self.manifest.get("identity") != identity:
                changes = identity_changes(self.manifest.get("identity") or {}, identity)
                raise DraftsmithError(
                    f"capture: {self.root} holds a store made with other settings",
                    got="; ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())[:600],
                    expected="the settings this store was captured with (its manifest.json identity)",
                    fix="did you mean to resume it? run with the store's settings; for a new store pick another "
                        "--out (or delete this one to recapture)")
        else:
            self.manifest = {"version": STORE_VERSION, "identity": identity, "complete": False, "shards": [],
                             "num_samples": 0, "num_tokens": 0, "num_supervised_tokens": 0}
        self.pending: list[Sample] = []
        self.pending_tokens = 0
        if path.exists():  # one process writes a store: held from here (a resume), or from its first write
            hold(self.root, "capture")
        self.drop_corrupt_shards()

    def drop_corrupt_shards(self) -> None:
        """Resume: the first listed shard whose file no longer matches its sha256 (a flipped bit, a cut copy) and
        every shard after it leave the manifest and the disk, so that this capture writes them again. A missing
        file stays listed: a trainer following the store (`--delete-consumed`) deletes the shards it trained on."""
        shards = self.manifest["shards"]
        for i, entry in enumerate(shards):
            try:
                if sha256_file(self.root / entry["file"]) == entry["sha256"]:
                    continue
            except FileNotFoundError:
                continue
            kept = shards[:i]
            print(f"capture: {entry['file']} does not match its sha256: recapturing it and the "
                  f"{len(shards) - i - 1} shards after it", file=sys.stderr, flush=True)
            self.manifest.update(shards=kept, complete=False, num_samples=sum(e["num_samples"] for e in kept),
                                 num_tokens=sum(e["num_tokens"] for e in kept),
                                 num_supervised_tokens=sum(e["num_supervised_tokens"] for e in kept))
            self.save_manifest()  # first, so that no manifest lists a shard file that is gone
            for dropped in shards[i:]:
                (self.root / dropped["file"]).unlink(missing_ok=True)
            return

    @property
    def samples_done(self) -> int:
        """Samples already in complete shards: the resume point."""
        return sum(s["num_samples"] for s in self.manifest["shards"])

    def add(self, sample: Sample) -> None:
        self.pending.append(sample)
        self.pending_tokens += len(sample.input_ids)
        if self.pending_tokens >= self.shard_tokens:
            self.flush()

    def shard_bytes_on_disk(self) -> int:
        """Bytes of this store's shard files still on disk (a follower with --delete-consumed removes them)."""
        total = 0
        for shard in self.manifest["shards"]:
            try:
                total += (self.root / shard["file"]).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def wait_for_room(self, nbytes: int) -> None:
        """Back-pressure: block until the shards on disk plus `nbytes` fit `max_store_bytes`, so that a capture
        faster than the trainer following it (`train --follow --delete-consumed`) never holds more than that."""
        if self.max_store_bytes is None:
            return
        deadline = time.monotonic() + self.room_timeout_s
        while (held := self.shard_bytes_on_disk()) + nbytes > self.max_store_bytes:
            if held == 0:
                raise DraftsmithError("a single shard is larger than --max-store-bytes",
                                      got=f"{nbytes} bytes for one shard", expected=f"<= {self.max_store_bytes}",
                                      fix="lower --shard-tokens or raise --max-store-bytes")
            if time.monotonic() > deadline:
                raise DraftsmithError(
                    "the store stayed full: no shard was consumed while the capture waited for room",
                    got=f"{held} bytes of shards on disk for {self.room_timeout_s:.0f} s, limit {self.max_store_bytes}",
                    expected="a trainer following this store with `train --follow --delete-consumed`",
                    fix=f"start `draftsmith train --store {self.root} --follow --delete-consumed ...`, or raise "
                        "--max-store-bytes (the capture resumes where it stopped when rerun)")
            time.sleep(0.2)

    def flush(self) -> None:
        if not self.pending:
            return
        hold(self.root, "capture")
        self.wait_for_room(sum(bytes_per_sample(s) for s in self.pending))
        index = len(self.manifest["shards"])
        name = f"shard-{index:05d}.safetensors"
        digest, tokens = write_shard_file(self.root / name, self.pending)
        per_sample = [int(s.loss_mask.sum()) for s in self.pending]
        supervised = sum(per_sample)
        # lengths / supervised per sample: what a trainer following the store plans with (train --follow)
        self.manifest["shards"].append({"file": name, "num_samples": len(self.pending), "num_tokens": tokens,
                                        "num_supervised_tokens": supervised, "sha256": digest,
                                        "lengths": [len(s.input_ids) for s in self.pending],
                                        "supervised": per_sample})
        self.manifest["num_samples"] += len(self.pending)
        self.manifest["num_tokens"] += tokens
        self.manifest["num_supervised_tokens"] += supervised
        self.save_manifest()
        self.pending, self.pending_tokens = [], 0

    def save_manifest(self) -> None:
        atomic_write_bytes(self.root / MANIFEST, (json.dumps(self.manifest, indent=2) + "\n").encode())

    def publish(self, token_counts: torch.Tensor, target_tensors: dict[str, torch.Tensor]) -> None:
        """Write the token counts and the target head now, before the shards, so that a trainer can follow
        the store while it is written (`train --follow`); both captures know them before capturing.

        Each is written once: a file that already holds the same tensors (a resumed capture, `finish`) is kept, and
        one that holds others is unpublished and deleted before the new one is written, so that a resume after a
        full disk never needs room for the target head twice."""
        hold(self.root, "capture")
        for name, tensors in ((TOKEN_COUNTS, {"counts": token_counts.to(torch.int64)}), (TARGET_HEAD, target_tensors)):
            path, key = self.root / name, name.split(".")[0] + "_sha256"
            if holds(path, tensors) and key in self.manifest:
                continue
            if path.exists():
                self.manifest.pop(key, None)
                self.save_manifest()
                path.unlink()
            atomic_save_tensors(path, tensors)
            self.manifest[key] = sha256_file(path)
        self.save_manifest()

    def finish(self, token_counts: torch.Tensor, target_tensors: dict[str, torch.Tensor], extra: dict) -> None:
        """Write the last shard, the token counts and the target head, and mark the store complete."""
        self.flush()
        self.publish(token_counts, target_tensors)
        self.manifest.update(extra, complete=True)
        self.save_manifest()


class FeatureStore:
    """Read side: memory-mapped shards, verified before trusted.

    Args:
        root: the store directory.
        verify_on_read: check a shard's sha256 the first time it is opened.
    """

    def __init__(self, root: Path, verify_on_read: bool = True, follow: bool = False):
        self.root = Path(root)
        self.follow = follow
        path = self.root / MANIFEST
        if not path.is_file():
            raise DraftsmithError("not a feature store", got=f"no {MANIFEST} in {self.root}",
                                  expected="a directory written by `draftsmith capture`",
                                  fix="run `draftsmith capture --out DIR` first, or point at the right directory")
        self.manifest = load_manifest(self.root)
        if self.manifest.get("version") != STORE_VERSION:
            raise DraftsmithError("feature store written by another draftsmith version",
                                  got=f"store version {self.manifest.get('version')}", expected=f"version {STORE_VERSION}",
                                  fix="recapture it with this version (`draftsmith capture` into a new --out)")
        if not (follow or self.manifest.get("complete")):
            raise DraftsmithError("the feature store is incomplete", got=f"{len(self.manifest['shards'])} shards, "
                                  "capture did not finish", expected="a complete store",
                                  fix="rerun the same `draftsmith capture` command: it resumes")
        self.verify_on_read = verify_on_read
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}
        self.aside: dict[int, tuple[Path, dict[int, int]]] = {}  # set_aside: shard -> (kept file, local -> position)
        self.index = [(i, j) for i, s in enumerate(self.manifest["shards"]) for j in range(s["num_samples"])]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def refresh(self) -> list[dict]:
        """Follow mode: re-read the manifest; returns the entries of the shards that landed since."""
        assert self.follow, "refresh() is for a store opened with follow=True"
        old = len(self.manifest["shards"])
        self.manifest = load_manifest(self.root)
        new = self.manifest["shards"][old:]
        self.index += [(old + i, j) for i, s in enumerate(new) for j in range(s["num_samples"])]
        return new

    @property
    def identity(self) -> dict[str, Any]:
        return self.manifest["identity"]

    @property
    def hidden_size(self) -> int:
        return int(self.identity["hidden_size"])

    def __len__(self) -> int:
        return len(self.index)

    def check_target(self, target_identity: dict[str, Any]) -> None:
        """Refuse a store captured from another target."""
        mine = self.identity["target"]
        if mine.get("config_sha256") != target_identity.get("config_sha256"):
            raise DraftsmithError("the feature store was captured from a different target",
                                  got=f"store target {mine.get('name')} (config {mine.get('config_sha256', '')[:12]})",
                                  expected=f"{target_identity.get('name')} (config "
                                  f"{target_identity.get('config_sha256', '')[:12]})",
                                  fix="capture a store for this target, or train against the store's target")

    def verify_shard(self, i: int) -> None:
        entry = self.manifest["shards"][i]
        path = self.root / entry["file"]
        if not path.is_file():
            raise DraftsmithError(f"feature-store shard {entry['file']} is missing", got=f"no {path}",
                                  expected="every shard the manifest lists",
                                  fix="a `train --follow --delete-consumed` deletes the shards it trained on: resume "
                                  "that run (same --out), or recapture into a new store")
        if sha256_file(path) != entry["sha256"]:
            raise corrupt_shard(self.root, entry)
        self._verified.add(entry["file"])

    def verify(self) -> int:
        """Check every shard's sha256; returns the number verified."""
        for i in range(len(self.manifest["shards"])):
            self.verify_shard(i)
        return len(self.manifest["shards"])

    def _open(self, i: int):
        entry = self.manifest["shards"][i]
        if entry["file"] not in self._handles:
            if self.verify_on_read and entry["file"] not in self._verified:
                self.verify_shard(i)
            handle = safe_open(str(self.root / entry["file"]), framework="pt")
            self._handles[entry["file"]] = (handle, handle.get_tensor("offsets"))
        return self._handles[entry["file"]]

    def set_aside(self, i: int, kept: list[int], path: Path | None) -> None:
        """Shard i is deleted (`train --follow --delete-consumed`): close its file (so that its disk is freed);
        from now on its samples `kept` (local indices, in this order) are read from `path`, a shard file
        holding only them, and any other sample of it is an error."""
        self._handles.pop(self.manifest["shards"][i]["file"], None)
        self.aside[i] = (Path(path) if path else Path(), {j: p for p, j in enumerate(kept)})

    def _locate(self, k: int):
        """((handle, offsets), position) of sample k: in its shard, or in the file it was set aside to."""
        i, j = self.index[k]
        if i not in self.aside:
            return self._open(i), j
        path, positions = self.aside[i]
        if j not in positions:
            raise DraftsmithError(f"sample {k} was read after its shard was deleted",
                                  got=f"{self.manifest['shards'][i]['file']} deleted by --delete-consumed",
                                  expected="only held-back samples read once their shard is consumed",
                                  fix="a bug in draftsmith's deletion schedule: please report it; rerun without "
                                  "--delete-consumed")
        if str(path) not in self._handles:
            handle = safe_open(str(path), framework="pt")
            self._handles[str(path)] = (handle, handle.get_tensor("offsets"))
        return self._handles[str(path)], positions[j]

    def sample(self, k: int) -> Sample:
        """The k-th sample, read by slicing the memory-mapped shard."""
        (handle, offsets), j = self._locate(k)
        a, b = int(offsets[j]), int(offsets[j + 1])
        return Sample(*(handle.get_slice(name)[a:b] for name in SHARD_TENSORS))

    def sample_length(self, k: int) -> int:
        (_, offsets), j = self._locate(k)
        return int(offsets[j + 1] - offsets[j])

    def token_counts(self) -> torch.Tensor:
        with safe_open(str(self.root / TOKEN_COUNTS), framework="pt") as f:
            return f.get_tensor("counts")

    def target_tensors(self) -> dict[str, torch.Tensor]:
        with safe_open(str(self.root / TARGET_HEAD), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def __iter__(self) -> Iterator[Sample]:
        for k in range(len(self)):
            yield self.sample(k)
