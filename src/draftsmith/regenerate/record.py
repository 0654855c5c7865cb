"""The settings an output of `regenerate` was written with, and the check that a rerun appends only to its own.

Beside OUT (conversations JSONL, or a prompt JSONL with --prompts-only) regenerate keeps OUT.settings.json: the
settings that decide what an answer says (`shaping`). A rerun appends to OUT only when they are the same (the
others may change: --limit extends a run, batch sizes, devices, endpoints and their retries change how, not
what, it answers); other settings, or an OUT with no record, are refused before any work, with --overwrite as
the fix (it deletes OUT and its record, nothing else).

    settings = shaping(s, target="smollm2", backend="local", prompts_only=False)
    check_append(out, settings, overwrite=False)    # refuse, or record the settings of a new OUT
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from draftsmith.config import as_flags, changed, shown_changes
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import hold

ANSWERS = ("prompts", "max_new_tokens", "temperature", "top_p", "reasoning")
"""What every backend's answers depend on."""
LOCAL = ("seed", "dtype")
"""The local target's answers also depend on these."""
SELF = ("self_count", "self_kinds", "self_temperature", "self_top_p", "self_seed", "multi_turn", "max_turn_tokens")
"""--prompts self: the user turns depend on these."""


def record_path(out: Path) -> Path:
    out = Path(out).resolve()  # `.` has no name of its own
    return out.with_name(out.name + ".settings.json")


def shaping(settings, target: str, backend: str, prompts_only: bool) -> dict:
    """The settings (a RegenerateSettings) that decide what `regenerate` writes into OUT; the local target's
    sampling as it resolves null (greedy)."""
    keys = ANSWERS + (LOCAL if backend == "local" else ("model",)) + (SELF if settings.prompts == "self" else ())
    values = {k: getattr(settings, k) for k in keys}
    if backend == "local":
        local = settings.local()
        values.update(temperature=local.temperature, top_p=local.top_p)
    return {"target": target, "backend": backend, "prompts_only": prompts_only, **values}


def check_append(out: Path, settings: dict, overwrite: bool) -> None:
    """Refuse OUT when it holds lines written with other settings, or lines with no record; else (an empty or new
    OUT, or --overwrite) record `settings` beside it. Before any work.

    Raises:
        DraftsmithError: exit 2, naming each differing setting (old -> new) and the fixes.
    """
    out, path = Path(out), record_path(Path(out))
    fixes = "for a new file pass another --out, or add --overwrite to replace it"
    if out.is_dir():
        raise DraftsmithError("regenerate: --out names a folder", got=str(out), expected="a JSONL file",
                              fix="pass a file, e.g. --out conversations.jsonl")
    hold(out, "regenerate", folder=False)  # one writer at a time, before --overwrite removes anything
    if overwrite:
        out.unlink(missing_ok=True)
    if out.is_file() and out.stat().st_size > 0:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            raise DraftsmithError(f"regenerate: {out} holds lines regenerate has no record of",
                                  got=f"no readable {path.name} beside it",
                                  expected=f"a new file, or one regenerate wrote (its settings in {path.name})",
                                  fix=fixes) from None
        if changes := changed(old, settings):
            raise DraftsmithError(f"regenerate: {out} was written with other settings", got=shown_changes(changes),
                                  expected=f"the settings {path} records (--limit, batch sizes, devices and "
                                           "endpoints may change)",
                                  fix=f"did you mean to continue it? run with "
                                      f"{as_flags({k: old for k, (old, _) in changes.items()})}; {fixes}")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def removed_if_unwritten(out: Path) -> Iterator[None]:
    """A command that fails before it writes a line leaves no file behind: the empty OUT and its record that this
    command made (neither existed before it) go again. Anything that existed before is left as it is."""
    out = Path(out)
    existed = out.exists() or record_path(out).exists()
    try:
        yield
    except BaseException:
        if not existed and out.is_file() and out.stat().st_size == 0:
            out.unlink()
            record_path(out).unlink(missing_ok=True)
        raise
