"""benchmarks/llamacpp_step_costs.py, the parts that need no llama-server: the statistics line llama.cpp logs
after each request, the split of a measured cycle, the speed-up bound and the tau it needs; and
benchmarks/machine_load.py's share of the machine that other processes took."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llamacpp_step_costs as costs  # noqa: E402
import machine_load  # noqa: E402

# Real lines from llama-server (llama-cpp-python 0.3.36) at `-lv 4`, SmolLM2 q8_0 with the shipped drafter, k=3:
# after a prompt-only request, and after a 64-token generation.
NO_DRAFTS = ("0.01.136.216 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   12      0      0, "
             "#gen drafts =      0, #acc drafts =     0, #gen tokens =      0, #acc tokens =     0, "
             "dur(b,g,a) = 0.022, 0.000, 0.000 ms")
DRAFTED = ("0.01.709.716 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =   14     21     21, "
           "#gen drafts =     21, #acc drafts =    16, #gen tokens =     63, #acc tokens =    41, #mean acc len = 2.95, "
           "#acc rate/pos = (0.762, 0.619, 0.571), dur(b,g,a) = 0.024, 31.231, 0.024 ms")


def test_statistics_lines_parse_with_and_without_drafts():
    assert costs.parse_spec_stats(NO_DRAFTS) == costs.SpecStats(draft_calls=0, draft_ms=0.0, gen_tokens=0, acc_tokens=0)
    assert costs.parse_spec_stats(DRAFTED) == costs.SpecStats(draft_calls=21, draft_ms=31.231, gen_tokens=63,
                                                              acc_tokens=41)
    assert costs.parse_spec_stats("0.01.709.620 I slot print_timing: id  0 | task 26 | eval time = 539.13 ms") is None


def test_a_request_window_is_the_difference_of_two_cumulative_lines():
    window = costs.parse_spec_stats(DRAFTED).minus(costs.parse_spec_stats(NO_DRAFTS))
    assert window.draft_calls == 21 and window.draft_ms == pytest.approx(31.231)
    assert window.draft_ms / window.draft_calls == pytest.approx(1.487, abs=1e-3)  # ms per draft() call at k=3


def test_a_cycle_splits_into_verification_drafts_and_the_rest():
    c = costs.split_cycle(k=3, plain_ms=9.0, cycle_ms=28.0, verify_ms=21.0, draft_call_ms=1.5)
    assert c.draft_step_ms == pytest.approx(0.5)
    assert c.overhead_ms == pytest.approx(28.0 - 21.0 - 1.5)
    assert c.cycle_ms == pytest.approx(28.0)


def test_the_bound_and_the_tau_it_needs_are_one_formula_read_both_ways():
    c = costs.CycleCosts(k=3, plain_ms=10.0, verify_ms=15.0, draft_step_ms=1.0, overhead_ms=2.0)  # cycle 20 ms
    assert c.speedup(tau=3.0) == pytest.approx(1.5)  # 3 tokens per 20 ms against 1 per 10 ms
    assert c.tau_needed(1.5) == pytest.approx(3.0)
    assert c.tau_needed(1.0) == pytest.approx(2.0)
    assert c.speedup(c.tau_needed(1.23)) == pytest.approx(1.23)


def test_foreign_load_is_the_machines_busy_time_minus_our_own():
    assert machine_load.foreign_cores(busy_s=1.5, ours_s=1.0, wall_s=1.0) == pytest.approx(0.5)
    assert machine_load.foreign_cores(busy_s=0.9, ours_s=1.0, wall_s=1.0) == 0.0  # tick rounding never goes negative
    assert machine_load.foreign_cores(busy_s=1.0, ours_s=0.0, wall_s=0.0) == 0.0


def test_builds_name_their_binaries_and_bad_ones_stop_before_any_server_starts(tmp_path):
    binary = tmp_path / "A" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert costs.parse_builds("") is None
    assert costs.parse_builds(f"old=default,new={tmp_path / 'A'},direct={binary}") == {
        "old": None, "new": binary, "direct": binary}
    for bad in ("noequals", f"a/b={binary}", f"x={tmp_path / 'missing'}"):
        with pytest.raises(SystemExit):
            costs.parse_builds(bad)


def test_each_build_is_summarised_from_its_own_servers_only():
    def rows(plain_ms, cycle_ms):
        return ([{"ext": {n: plain_ms * (1 + 0.2 * (n - 1)) for n in range(1, 9)}, "plain_ms": plain_ms}],
                [{"ext": {n: plain_ms * (1 + 0.2 * (n - 1)) + 1 for n in range(1, 9)}, "cycle_ms": cycle_ms,
                  "draft_call_ms": 3.0}])
    samples, chat = {}, {}
    for build, plain_ms, cycle_ms in (("old", 10.0, 30.0), ("new", 10.0, 25.0)):
        samples[f"{build}/plain"], samples[f"{build}/k3"] = rows(plain_ms, cycle_ms)
        chat[f"{build}/k3"] = {"tau": 2.5, "speedup": 1.0}
    old, new = (costs.summarize(samples, [3], chat, b)["per_k"][0] for b in ("old", "new"))
    assert old["cycle_ms"] == 30.0 and new["cycle_ms"] == 25.0
    assert new["bound_speedup"] == pytest.approx(2.5 * 10.0 / 25.0)
    assert costs.summarize(samples, [3], chat)["chat"] is chat  # no build named: no plain server of its own
