"""Score `draftsmith check` on the corpus of real preflight cases (tests/fixtures/check_corpus/).

Each case is a real (target, drafter, engine, version, settings) combination from a public issue thread or
engine doc, with the outcome that thread reports: `start` (the server did not come up), `serve` (it came up
and died on a request), `accept` (it served with collapsed acceptance) or `fine`. check's prediction is the
kind of its first error finding (start before serve before accept), else `fine`.

The split into `development` and `held-back` is fixed by the SHA-256 of the case's source URL (README.md in the
corpus folder); rules are tuned on the development half only.

Run: `PYTHONPATH=src .venv/bin/python scripts/check_corpus.py` -> benchmarks/results/check_corpus.json (the
command, the per-half scores of the result it replaces under `previous`, a summary of both halves, and the
development half's rows). Held-back rows are neither printed nor written: which held-back cases fail is not for
whoever changes the rules to read. `--half development` scores the development half alone and writes nothing:
the command to run while changing rules, so that the held-back half is scored only when a pass is done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "check_corpus"
TARGETS = ROOT / "tests" / "fixtures" / "configs" / "targets"
DRAFTERS = ROOT / "tests" / "fixtures" / "configs" / "drafters"
RESULT = ROOT / "benchmarks" / "results" / "check_corpus.json"
OUTCOMES = ("start", "serve", "accept", "fine")


def half(source: str) -> str:
    """`development` when the first hex digit of sha256(source URL) is 0-7, else `held-back`."""
    return "development" if int(hashlib.sha256(source.encode()).hexdigest()[0], 16) < 8 else "held-back"


def load_cases() -> list[dict]:
    return yaml.safe_load((CORPUS / "cases.yaml").read_text())["cases"]


def split_table(cases: list[dict]) -> dict[str, list[str]]:
    """Case ids per half, as committed in split.json (the test checks the file still matches the rule)."""
    out: dict[str, list[str]] = {"development": [], "held-back": []}
    for case in cases:
        out[half(case["source"])].append(case["id"])
    return out


def _write_model(folder: Path, spec: str | dict, fixtures: Path) -> Path:
    if isinstance(spec, str):
        return fixtures / spec
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(spec))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def predict(case: dict, work: Path) -> tuple[str, list[str]]:
    """check's predicted outcome for a case, and its error findings (rule ids, first error first)."""
    from draftsmith.check import run_checks

    target = _write_model(work / "target", case["target"], TARGETS)
    drafter = _write_model(work / "drafter-eagle3", case["drafter"], DRAFTERS)
    spec = case.get("speculative_config")
    findings, _ = run_checks(target, drafter, case["engine"], str(case["version"]),
                             json.dumps(spec) if spec is not None else None, case.get("engine_args", ""),
                             gpu=case.get("gpu"))
    errors = [f for f in findings if f.severity == "error"]
    for kind in OUTCOMES[:3]:
        if any(f.kind == kind for f in errors):
            return kind, [f.rule for f in errors]
    return "fine", [f.rule for f in errors]


def score(cases: list[dict]) -> dict:
    rows, tally = [], defaultdict(lambda: [0, 0])
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                got, rules = predict(case, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a case check cannot read counts as a miss, with the reason
                got, rules = f"error: {exc}".splitlines()[0], []
        part = half(case["source"])
        ok = got == case["observed"]
        rows.append({"id": case["id"], "half": part, "engine": case["engine"], "observed": case["observed"],
                     "predicted": got, "correct": ok, "errors": rules})
        for key in (part, f"{part}/outcome={case['observed']}", f"{part}/engine={case['engine']}"):
            tally[key][0] += ok
            tally[key][1] += 1
    summary = {k: {"correct": c, "cases": n, "accuracy": round(c / n, 3)} for k, (c, n) in sorted(tally.items())}
    return {"summary": summary, "cases": rows}


COMMAND = "PYTHONPATH=src .venv/bin/python scripts/check_corpus.py"


def previous_halves() -> dict:
    """The per-half scores of the committed result this run replaces ({} when there is none)."""
    try:
        summary = json.loads(RESULT.read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return {}
    return {half_: summary[half_] for half_ in ("development", "held-back") if half_ in summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--half", choices=("both", "development"), default="both",
                   help="both (default): score both halves and write the result file; development: score the "
                        "development half only, print it, write nothing")
    args = p.parse_args(argv)
    cases = load_cases()
    (CORPUS / "split.json").write_text(json.dumps(split_table(cases), indent=1) + "\n")
    if args.half == "development":
        cases = [c for c in cases if half(c["source"]) == "development"]
    scored = score(cases)
    dev_rows = [row for row in scored["cases"] if row["half"] == "development"]
    result = {"command": COMMAND, "previous": previous_halves(), "summary": scored["summary"], "cases": dev_rows}
    if args.half == "both":
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
    for key, row in result["summary"].items():
        print(f"{key:40s} {row['correct']:3d}/{row['cases']:<3d} {row['accuracy']:.3f}")
    for row in dev_rows:
        if not row["correct"]:
            print(f"MISS {row['half']:11s} {row['id']}: observed {row['observed']}, predicted {row['predicted']} "
                  f"{row['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
