"""The files a user hands draftsmith, read by one reader per format: UTF-8 text, JSON, JSON Lines and YAML.

Every error names the file, the line (and the column where the parser knows it), what was expected (UTF-8 text,
JSON, one JSON object per line, a YAML mapping) and the fix, so a bad file stops a verb with exit 2 before any work
instead of a traceback. The checks of what the records mean (a conversation's messages, a prompt's user turn) stay
with the verb that reads them; they get the line number from `read_jsonl`.

    config = read_json(drafter / "config.json", "drafter config", fix="re-export the drafter")
    for lineno, record in read_jsonl(path, "conversations file"):
        ...
    mapping = read_yaml(path, "run config")
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from draftsmith.errors import DraftsmithError

SHOWN = 120  # characters of a bad line quoted in an error


def default_fix(path: Path, line: int | None = None) -> str:
    where = f"line {line} of {path}" if line else str(path)
    return f"correct {where}, or write the file again with the tool that made it"


def unreadable(path: Path, what: str, exc: OSError, fix: str | None = None) -> DraftsmithError:
    """The error for a missing, folder or unreadable `path`."""
    if isinstance(exc, FileNotFoundError):
        return DraftsmithError(f"{what} not found", got=f"no file {path}", expected=f"the {what}",
                               fix=fix or "check the path")
    if isinstance(exc, IsADirectoryError):
        return DraftsmithError(f"{what} is a folder", got=f"{path} is a folder", expected=f"the {what}, a file",
                               fix=fix or "pass the file, not its folder")
    return DraftsmithError(f"cannot read the {what}", got=f"{path}: {exc.strerror or exc}",
                           expected="a readable file", fix=fix or "check the path and its permissions")


def read_bytes(path: Path, what: str, fix: str | None = None) -> bytes:
    """The bytes of `path`; a missing, unreadable or folder path is a named error."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise unreadable(Path(path), what, exc, fix) from exc


def decode(data: bytes, path: Path, what: str, fix: str | None = None, first_line: int = 1) -> str:
    """`data` as UTF-8 text; an invalid byte is named by line and column (1-based, in bytes)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + data.count(b"\n", 0, exc.start)
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise DraftsmithError(f"{what} {path} is not UTF-8 text at line {line}, column {column}",
                              got=f"byte {data[exc.start]:#04x} ({exc.reason})", expected="UTF-8 text",
                              fix=fix or f"save {path} as UTF-8 (e.g. iconv -t UTF-8), or {default_fix(path, line)}"
                              ) from exc


def read_text(path: Path, what: str, fix: str | None = None) -> str:
    """The UTF-8 text of `path`."""
    return decode(read_bytes(path, what, fix), Path(path), what, fix)


def read_json(path: Path, what: str, fix: str | None = None) -> dict[str, Any]:
    """The JSON object in `path`.

    Raises:
        DraftsmithError: a missing or unreadable file, invalid UTF-8, invalid JSON (with line and column, as
            in a cut file), or JSON that is not an object.
    """
    path = Path(path)
    text = read_text(path, what, fix)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        lines = text.splitlines()
        line = lines[exc.lineno - 1] if exc.lineno <= len(lines) else ""
        raise DraftsmithError(f"{what} {path} is not valid JSON at line {exc.lineno}, column {exc.colno}",
                              got=f"not JSON: {exc.msg}" + (f": {line.strip()[:SHOWN]}" if line.strip() else
                                                  " (the file is empty or cut short)"),
                              expected="a JSON object", fix=fix or default_fix(path, exc.lineno)) from exc
    if not isinstance(value, dict):
        raise DraftsmithError(f"{what} {path} is not a JSON object", got=f"a JSON {type(value).__name__}",
                              expected="a JSON object {...}", fix=fix or default_fix(path))
    return value


def read_jsonl(path: Path, what: str, fix: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (1-based line number, object) for every non-blank line of a JSON Lines file, streamed.

    Raises:
        DraftsmithError: a missing file, or a line that is not UTF-8, not JSON or not a JSON object.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise unreadable(path, what, exc, fix) from exc
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = decode(raw, path, what, fix, first_line=lineno)
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DraftsmithError(f"{what} {path}: line {lineno} is not valid JSON (column {exc.colno})",
                                      got=f"{exc.msg}: {line.strip()[:SHOWN]}", expected="one JSON object per line",
                                      fix=fix or f"fix or delete line {lineno} of {path}") from exc
            if not isinstance(value, dict):
                raise DraftsmithError(f"{what} {path}: line {lineno} is not a JSON object",
                                      got=f"a JSON {type(value).__name__}: {line.strip()[:SHOWN]}",
                                      expected="one JSON object per line",
                                      fix=fix or f"fix or delete line {lineno} of {path}")
            yield lineno, value


def read_yaml(path: Path, what: str, fix: str | None = None) -> dict[str, Any]:
    """The YAML mapping in `path` (an empty file is an empty mapping).

    Raises:
        DraftsmithError: a missing file, invalid UTF-8, a YAML syntax error (with line and column), or a
            document that is not a mapping.
    """
    path = Path(path)
    text = read_text(path, what, fix)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise DraftsmithError(f"{what} {path} is not valid YAML{at}", got=problem, expected="YAML key: value pairs",
                              fix=fix or default_fix(path, mark.line + 1 if mark is not None else None)) from exc
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DraftsmithError(f"{what} {path} is not a YAML mapping", got=f"a {type(value).__name__}: "
                              f"{str(value)[:SHOWN]}", expected="key: value pairs at the top level",
                              fix=fix or "check the YAML indentation")
    return value
