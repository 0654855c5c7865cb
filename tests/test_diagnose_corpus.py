"""The diagnose corpus (tests/fixtures/diagnose_corpus, sets 1 and 2): each split is the committed hash, and
no development half's score drops. The held-back halves are scored too, and only reported."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "diagnose_corpus"


def _script():
    spec = importlib.util.spec_from_file_location("diagnose_corpus", REPO / "scripts" / "diagnose_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


SCRIPT = _script()
CASES = SCRIPT.load_index()


def test_corpus_is_large_real_and_split_by_the_committed_hash():
    assert len([c for c in CASES if c["set"] == "set1"]) >= 60
    assert len([c for c in CASES if c["set"] == "set2"]) >= 20
    assert {c["engine"] for c in CASES} == {"vllm", "sglang"}
    assert all(c["source"].startswith("https://github.com/") and c["date"] for c in CASES)
    assert all(c["split"] == SCRIPT.split_of(c["source"]) for c in CASES)
    assert {c["split"] for c in CASES} == {"dev", "held_back"}


def test_set2_split_file_is_the_committed_hash_split():
    split = json.loads((CORPUS / "set2" / "split.json").read_text())
    cases = [c for c in CASES if c["set"] == "set2"]
    for half in SCRIPT.SPLITS:
        assert split[half] == sorted(c["id"] for c in cases if SCRIPT.split_of(c["source"]) == half)


def test_sources_are_not_shared_between_sets():
    set1 = {c["source"] for c in CASES if c["set"] == "set1"}
    assert not set1 & {c["source"] for c in CASES if c["set"] == "set2"}


def test_expected_line_holds_the_expected_text():
    for c in CASES:
        lines = (SCRIPT.SETS[c["set"]] / c["file"]).read_text(encoding="utf-8").split("\n")
        assert c["expected"]["contains"] in lines[c["expected"]["line"] - 1], c["id"]


def test_development_halves_do_not_drop_below_their_recorded_scores():
    recorded = json.loads((CORPUS / "recorded_score.json").read_text())["dev"]
    score = SCRIPT.score([SCRIPT.judge(c) for c in CASES])
    for half, rec in recorded.items():
        got = score[half]
        assert got["total"] == rec["total"], f"{half} changed: re-record its score"
        assert got["right"] >= rec["right"], (
            f"{half} {got['right']}/{got['total']} < recorded {rec['right']}; "
            f"see `.venv/bin/python scripts/diagnose_corpus.py --half dev --show dev`")
