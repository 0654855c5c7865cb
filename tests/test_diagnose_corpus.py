"""The diagnose corpus (tests/fixtures/diagnose_corpus): its split is the committed hash, and the
development half's score does not drop. The held-back half is scored too, and only reported."""

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
    assert len(CASES) >= 60
    assert {c["engine"] for c in CASES} == {"vllm", "sglang"}
    assert all(c["source"].startswith("https://github.com/") and c["date"] for c in CASES)
    assert all(c["split"] == SCRIPT.split_of(c["source"]) for c in CASES)
    assert {c["split"] for c in CASES} == {"dev", "held_back"}


def test_expected_line_holds_the_expected_text():
    for c in CASES:
        lines = (CORPUS / c["file"]).read_text(encoding="utf-8").split("\n")
        assert c["expected"]["contains"] in lines[c["expected"]["line"] - 1], c["id"]


def test_development_half_does_not_drop_below_its_recorded_score():
    recorded = json.loads((CORPUS / "recorded_score.json").read_text())["dev"]
    score = SCRIPT.score([SCRIPT.judge(c) for c in CASES])
    dev, held = score["dev"], score["held_back"]
    assert dev["total"] == recorded["total"], "the corpus changed: re-record its score"
    assert dev["right"] >= recorded["right"], (
        f"dev {dev['right']}/{dev['total']} < recorded {recorded['right']} (held back {held['right']}/{held['total']}); "
        f"see `.venv/bin/python scripts/diagnose_corpus.py --show dev`")
