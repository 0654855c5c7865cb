"""Conversations JSONL: the append-only, resumable file that regeneration writes and capture reads.

One JSON object per line (docs/design.md, "Contracts between stages"):
`{"id": str, "messages": [{"role", "content", "reasoning_content"?}], "meta": {...}}`.

Writers append and fsync in batches; after a crash at any moment the file holds whole lines plus, at
worst, one torn last line, which `open_for_append` detects and truncates. Readers name the line number
of anything malformed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.files import read_jsonl

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "messages": self.messages, "meta": self.meta}, ensure_ascii=False)


def parse_conversation(obj: Any, where: str) -> Conversation:
    """Validate one decoded JSON object as a conversation; `where` names the file and line."""
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not isinstance(obj.get("messages"), list):
        raise DraftsmithError(f"not a conversation at {where}",
                              got=json.dumps(obj)[:120],
                              expected='{"id": str, "messages": [{"role": ..., "content": ...}], "meta": {...}}',
                              fix="regenerate the file with `draftsmith regenerate`, or fix that line")
    if not obj["messages"]:
        raise DraftsmithError(f"a conversation without messages at {where}", got=json.dumps(obj)[:120],
                              expected="at least one message", fix="delete that line, or regenerate the file")
    if not isinstance(obj.get("meta", {}), (dict, type(None))):
        raise DraftsmithError(f"bad meta at {where}", got=json.dumps(obj["meta"])[:120], expected="an object {...}",
                              fix="fix that line")
    for n, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DraftsmithError(f"bad message {n} at {where}", got=json.dumps(m)[:120],
                                  expected=f'{{"role": one of {", ".join(ROLES)}, "content": a string}}',
                                  fix="fix that line")
    return Conversation(obj["id"], obj["messages"], obj.get("meta") or {})


def read_conversations(path: Path) -> Iterator[Conversation]:
    """Every conversation of a conversations file, each line checked (`files.read_jsonl`, `parse_conversation`)."""
    for lineno, obj in read_jsonl(path, "conversations file"):
        yield parse_conversation(obj, f"{path}:{lineno}")


def unique_ids(lines: list[tuple[int, str]], path: Path, what: str) -> None:
    """Refuse an id that two lines of `path` share (`lines`: line number, id), naming both lines."""
    first: dict[str, int] = {}
    for lineno, id_ in lines:
        if id_ in first:
            raise DraftsmithError(f"{what} id {id_!r} appears twice in {path}", got=f"lines {first[id_]} and {lineno}",
                                  expected=f"each {what} id once (a resume skips the ids already done)",
                                  fix="delete or rename one of those lines")
        first[id_] = lineno


def check_conversations(path: Path) -> tuple[int, bool]:
    """Parse a conversations file whole, each bad line named and an id shared by two lines refused; returns the
    number of conversations and whether any has an assistant turn (the turns a drafter is trained on)."""
    convs = [(lineno, parse_conversation(obj, f"{path}:{lineno}")) for lineno, obj in read_jsonl(path, "conversations file")]
    unique_ids([(lineno, c.id) for lineno, c in convs], path, "conversation")
    return len(convs), any(m["role"] == "assistant" for _, c in convs for m in c.messages)


def finished_ids(path: Path) -> set[str]:
    """Ids already written to a conversations file (a torn last line is ignored, not an error)."""
    if not path.exists():
        return set()
    ids = set()
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # torn last line: its id is unfinished
            try:
                ids.add(json.loads(raw)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def truncate_torn_tail(path: Path) -> int:
    """Drop a last line that lacks its newline (left by a crash mid-write); returns bytes dropped."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        pos, chunk = size, 4096
        while pos > 0:
            step = min(chunk, pos)
            f.seek(pos - step)
            block = f.read(step)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = pos - step + nl + 1
                break
            pos -= step
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
            os.fsync(f.fileno())
        return size - keep


class ConversationWriter:
    """Append conversations exactly once: skip ids already present, fsync every `sync_every` records."""

    def __init__(self, path: Path, sync_every: int = 16):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped_bytes = truncate_torn_tail(self.path)
        self.done = finished_ids(self.path)
        self.sync_every = sync_every
        self._pending = 0
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, conv: Conversation) -> bool:
        """Append one conversation; returns False (and writes nothing) when its id is already done."""
        if conv.id in self.done:
            return False
        self._f.write(conv.to_json() + "\n")
        self.done.add(conv.id)
        self._pending += 1
        if self._pending >= self.sync_every:
            self.sync()
        return True

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._pending = 0

    def close(self) -> None:
        self.sync()
        self._f.close()

    def __enter__(self) -> ConversationWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
