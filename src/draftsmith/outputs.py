"""Output folders and files draftsmith owns: what it may replace, and writes that leave the old content whole.

draftsmith deletes or replaces only what it wrote itself and can prove it: a folder that holds its marker
(`MARKER`, written into every output folder a verb makes) or the verb's own manifest. A folder holding anything
else is refused, with `--overwrite` as the fix. Writes go to a temporary sibling that is renamed into place, so a
failure leaves the old content as it was. Files are written readable as the umask says (a temporary file is
created 0600, which an engine running as another user cannot read).

    check_output(out, "export")                   # refuse a folder of the user's, before any work
    with replace_dir(out, "export") as tmp:       # write into tmp; out is swapped in whole at the end
        save_file(tensors, tmp / "model.safetensors")
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from draftsmith.errors import DraftsmithError

MARKER = ".draftsmith.json"
"""Written into every output folder a verb makes: {"verb": ...}. Its presence is draftsmith's proof of ownership."""

LOCK = ".draftsmith.lock"
"""Held (flock) by the one process writing an output folder (`hold`); never an entry of the user's."""

SHOWN = 3  # entries named in a refusal

HELD: dict[Path, int] = {}
"""Locks this process holds, for its life: resolved output path -> open lock file descriptor."""


def umask_mode(executable: bool = False) -> int:
    """The mode a new file (0666) or folder (0777) gets under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if executable else 0o666) & ~mask


def marker(folder: Path) -> dict:
    """`folder`'s marker ({} when there is none, or it is unreadable)."""
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def written_by(folder: Path) -> str | None:
    """The verb that wrote `folder` (from its marker), or None when draftsmith cannot prove it wrote it."""
    record = marker(folder)
    return (record.get("verb") or "draftsmith") if record else None


def added_since(folder: Path) -> list[str]:
    """Entries of `folder` that its verb did not write (the marker lists what it wrote; a marker without a list,
    such as a run folder's, vouches for no list)."""
    wrote = marker(folder).get("entries")
    return [] if not isinstance(wrote, list) else [e for e in foreign_entries(folder) if e not in wrote]


def mark(folder: Path, verb: str, entries: list[str] | None = None) -> None:
    """Record that `verb` wrote `folder`, and (`entries`) the names it wrote there, so that a later write replaces
    the folder only while nothing else has been put in it."""
    record = {"verb": verb} if entries is None else {"verb": verb, "entries": sorted(entries)}
    (folder / MARKER).write_text(json.dumps(record) + "\n")
    os.chmod(folder / MARKER, umask_mode())


def foreign_entries(folder: Path) -> list[str]:
    """The names in `folder` other than the marker, sorted."""
    return sorted(p.name for p in folder.iterdir() if p.name != MARKER and not p.name.endswith(LOCK))


def lock_path(out: Path, folder: bool = True) -> Path:
    """The lock file of output `out`: inside a folder output, beside a file output."""
    out = Path(out).resolve()
    return out / LOCK if folder else out.parent / f".{out.name}{LOCK}"


def hold(out: Path, verb: str, flag: str = "--out", folder: bool = True) -> None:
    """Make this process the one writer of output `out` (a folder, or a file when not `folder`) until `holding`
    ends or the process does: an advisory lock (flock) on a lock file there, which the OS releases when the
    process ends, even by kill -9, so that a killed run still resumes. Holding it again in the same process is a
    no-op.

    Raises:
        DraftsmithError: another process holds `out` (named by its pid), before any work.
    """
    path = lock_path(out, folder)
    if path in HELD:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, umask_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            break
        try:  # the lock file a releasing holder removed is no lock: take the one at `path` now
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {verb}\n".encode())
                HELD[path] = fd
                return
        except FileNotFoundError:
            pass
        os.close(fd)
    holder = (os.read(fd, 64).decode(errors="replace").split() or ["unknown"])[0]
    os.close(fd)
    raise DraftsmithError(f"{verb}: {flag} {out} is in use by another draftsmith process",
                          got=f"pid {holder} holds {path}", expected=f"one process writing {flag} at a time",
                          fix=f"wait for pid {holder} to end (or stop it: a stopped run resumes), or pass "
                              f"another {flag}")


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """The locks `hold` takes inside the block are released when it ends, their lock files removed (a process
    killed keeps its lock file, which the OS has unlocked: the next `hold` takes it)."""
    before = set(HELD)
    try:
        yield
    finally:
        for path in [p for p in HELD if p not in before]:
            fd = HELD.pop(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)


def check_output(out: Path, verb: str, overwrite: bool = False, flag: str = "--out",
                 owns: Callable[[Path], bool] | None = None, overwrite_flag: bool = True) -> None:
    """Refuse `out` when it is not this verb's to replace: it exists, holds entries, and neither carries the marker
    of `verb` nor passes `owns` (a verb's own test, e.g. its manifest). A file in the way is refused too.

    Raises:
        DraftsmithError: exit 2, before any work.
    """
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise DraftsmithError(f"{verb}: {flag} names a file, not a folder", got=str(out),
                              expected="a new folder, or one draftsmith wrote", fix=f"pass another {flag}")
    entries = foreign_entries(out)
    if not entries or overwrite:
        return
    if written_by(out) == verb:
        entries = added_since(out)  # a folder this verb wrote: only what was put in it since is the user's
        if not entries:
            return
    elif owns is not None and owns(out):  # the verb's own proof (its manifest), from before markers listed entries
        return
    shown = ", ".join(entries[:SHOWN]) + (f" and {len(entries) - SHOWN} more" if len(entries) > SHOWN else "")
    fix = f"pass another {flag}" + (f", or add --overwrite to replace what is in {out}" if overwrite_flag else
                                    f", or move those files out of {out}")
    raise DraftsmithError(f"{verb}: {flag} {out} holds files draftsmith did not write", got=shown,
                          expected="a new or empty folder, or one this verb wrote", fix=fix)


def check_output_file(path: Path, verb: str, overwrite: bool = False, flag: str = "--json",
                      owns: Callable[[Path], bool] | None = None) -> None:
    """Refuse, before any work, a file output that names a folder, or an existing file draftsmith cannot show it
    wrote (`owns`: the verb's own test of the content), unless `overwrite`."""
    path = Path(path)
    if path.is_dir():
        raise DraftsmithError(f"{verb}: {flag} names a folder, not a file", got=str(path),
                              expected="a file path", fix=f"pass a file path as {flag}, e.g. {path / (verb + '.json')}")
    if path.exists() and not overwrite and not (owns is not None and owns(path)):
        raise DraftsmithError(f"{verb}: {flag} {path} is a file draftsmith did not write", got=str(path),
                              expected=f"a new file, or one `draftsmith {verb}` wrote",
                              fix=f"pass another {flag}, or add --overwrite to replace it")


def check_not_inside(out: Path, src: Path, verb: str, flag: str = "OUT", src_flag: str = "") -> None:
    """Refuse an output that is its own source (`src_flag`: the flag naming it), holds it, or lies inside it (even
    with --overwrite)."""
    o, s = Path(out).resolve(), Path(src).resolve()
    if o == s or o in s.parents or s in o.parents:
        example = s.parent / (s.stem + "-" + verb + s.suffix) if s.is_file() else s.parent / (s.name + "-" + verb)
        raise DraftsmithError(f"{verb}: {flag} overlaps the source {src_flag}".rstrip(),
                              got=f"{flag} {out}, {src_flag or 'source'} {src}",
                              expected="an output apart from the source, which draftsmith reads and never replaces",
                              fix=f"pass another {flag}, e.g. {flag} {example}")


def check_apart(out: Path | None, verb: str, flag: str, sources: dict[str, str | Path | None]) -> None:
    """Refuse an output (`flag`) that overlaps any of the verb's inputs that exist (`sources`: flag -> path; a
    built-in name that is no path is passed over), even with --overwrite."""
    if out is None:
        return
    for src_flag, src in sources.items():
        if src and Path(src).exists():
            check_not_inside(Path(out), Path(src), verb, flag, src_flag)


@contextlib.contextmanager
def replace_dir(out: Path, verb: str, overwrite: bool = False, flag: str = "--out",
                owns: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """A temporary sibling of `out` to write into; when the block ends without error, it is marked and renamed to
    `out` (the old folder, which `check_output` allowed, is swapped out and removed). On an error the temporary
    folder goes and `out` is left as it was."""
    out = Path(out)
    check_output(out, verb, overwrite, flag, owns)
    here = Path.cwd().resolve()
    if out.exists() and (out.resolve() == here or out.resolve() in here.parents):
        raise DraftsmithError(f"{verb}: {flag} is the working directory or holds it", got=str(out),
                              expected="a folder apart from the one this command runs in",
                              fix=f"pass a new folder as {flag}, e.g. {flag} ./{verb}-out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, umask_mode(executable=True))
        yield tmp
        mark(tmp, verb, foreign_entries(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
