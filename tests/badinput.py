"""The bad-input matrix's one assertion: a verb given a bad input exits 2 with a named error and changes nothing.

    before = snapshot(tmp_path)
    refused(capsys, ["export", str(src), str(out), "--format", "vllm"], tmp_path, before, "holds files")
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from draftsmith.cli import main

NAMED = ("got:", "expected:", "fix:")


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: its relative path, and its sha256 (a file) or "dir"."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*"))}


def refused(capsys, argv: list[str], folder: Path, before: dict[str, str], *words: str) -> str:
    """Run `draftsmith ARGV`; assert exit 2, a message naming what/got/expected/fix and holding `words`, and
    `folder` exactly as `before`. Returns the message."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}, expected 2 for {argv}; stderr: {err[-2000:]}"
    if not err.startswith("usage:") and "error: argument" not in err:
        missing = [w for w in NAMED if w not in err]
        assert not missing, f"the error does not name {missing}: {err[-2000:]}"
    for w in words:
        assert w in err, f"{w!r} not in the error: {err[-2000:]}"
    after = snapshot(folder)
    assert after == before, f"the folder changed: added {sorted(set(after) - set(before))}, removed " \
                            f"{sorted(set(before) - set(after))}, changed {sorted(k for k in before if k in after and before[k] != after[k])}"
    return err

