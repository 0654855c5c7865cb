"""Parsers of engine spec-decode metrics, on real samples (tests/fixtures/metrics/SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.bench.metrics import (
    SpecCounters,
    acceptance_from_counters,
    acceptance_from_sglang_log,
    parse_sglang_decode_line,
    parse_sglang_gauge,
    parse_sglang_server_info,
    parse_spec_counters,
)

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


# vLLM 0.10.2+ `SpecDecoding metrics` line quoted in docs/engines.md §5.2 (vllm-project/vllm#49560):
# Accepted 130, Drafted 268, mean acceptance length 2.94, per-position 0.836 0.567 0.343 0.194, 48.5 %.
# Its counters are reconstructed here: drafts = 268 / 4 = 67, accepted per position = rate * 67.
VLLM_49560 = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 67.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 268.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 130.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 56.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 38.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 23.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 13.0
"""


def test_vllm_counters_give_the_engine_log_line_numbers():
    source, counters = parse_spec_counters(VLLM_49560)
    acc = acceptance_from_counters(counters, source)
    assert source == "vllm"
    assert acc.tau == pytest.approx(2.94, abs=0.005)  # "Mean acceptance length: 2.94"
    assert acc.acceptance_rate == pytest.approx(0.485, abs=0.0005)  # "Avg Draft acceptance rate: 48.5%"
    assert acc.per_position == pytest.approx((0.836, 0.567, 0.343, 0.194), abs=0.002)
    assert acc.num_speculative_tokens == 4


def test_llamacpp_counters_share_the_vllm_shape():
    # llama.cpp `--metrics` names (docs/engines.md §8.5); same numbers as above
    text = VLLM_49560.replace("vllm:", "llamacpp:")
    source, counters = parse_spec_counters(text)
    assert source == "llamacpp"
    assert acceptance_from_counters(counters, source).tau == pytest.approx(2.94, abs=0.005)


def test_counters_sum_over_engines_and_ignore_created_samples():
    two_engines = VLLM_49560 + VLLM_49560.replace('engine="0"', 'engine="1"').replace(
        "# HELP", "# X").replace("# TYPE", "# Y")
    _, counters = parse_spec_counters(two_engines)
    assert counters.drafts == 134 and counters.accepted_per_pos[0] == 112


def test_real_vllm_cpu_pages_are_differenced_over_the_window():
    src_b, before = parse_spec_counters(read("vllm_cpu_spec_before.prom"))
    src_a, after = parse_spec_counters(read("vllm_cpu_spec_after.prom"))
    assert src_b == src_a == "vllm"
    assert before == SpecCounters(0, 0, 0, (0, 0, 0))  # registered at start-up, before any request
    acc = acceptance_from_counters(after.minus(before), "vllm")
    # an untrained drafter, k = 3: 128 drafts of 3 tokens, 4 accepted, all at position 0
    assert (acc.drafts, acc.draft_tokens, acc.accepted) == (128, 384, 4)
    assert acc.tau == pytest.approx(1 + 4 / 128) and acc.acceptance_rate == pytest.approx(4 / 384)
    assert acc.per_position == pytest.approx((4 / 128, 0, 0)) and acc.num_speculative_tokens == 3


def test_a_server_without_speculation_has_no_counters():
    assert parse_spec_counters(read("vllm_cpu_nospec.prom")) is None


def test_counters_that_go_down_mean_a_restart():
    big = SpecCounters(10, 30, 12, (6, 4, 2))
    with pytest.raises(ValueError, match="restarted"):
        SpecCounters(1, 3, 1, (1, 0, 0)).minus(big)


def test_no_drafts_gives_no_tau_rather_than_a_division_by_zero():
    acc = acceptance_from_counters(SpecCounters(0, 0, 0, (0, 0, 0)), "vllm")
    assert acc.tau is None and acc.acceptance_rate is None and acc.per_position == ()


def test_sglang_gauge_is_averaged_over_ranks_and_normalised_with_k():
    acc = parse_sglang_gauge(read("sglang_metrics.prom"), k=3)
    assert acc.source == "sglang-gauge" and not acc.windowed
    assert acc.tau == pytest.approx((3.13 + 3.05) / 2)
    assert acc.acceptance_rate == pytest.approx((acc.tau - 1) / 3)
    assert parse_sglang_gauge(read("vllm_cpu_nospec.prom")) is None


def test_sglang_server_info_reads_k_from_the_server_args():
    acc = parse_sglang_server_info(json.loads(read("sglang_server_info.json")))
    assert acc.tau == pytest.approx(3.20)
    # 4 draft tokens include the root: k = 3 drafted tokens per step (sgl-project/sglang#26506)
    assert acc.acceptance_rate == pytest.approx(2.20 / 3)
    assert parse_sglang_server_info({"internal_states": [{"avg_spec_accept_length": None}]}) is None


@pytest.mark.parametrize("lineno, accept_len, rate, running", [
    (2, 2.17, 0.54, 1),      # `Decode batch.` (sgl-project/sglang#11948)
    (8, 3.05, 0.68, 24),     # `Decode batch,` with TP0 EP0 prefix (sgl-project/sgl-kernel-npu#608)
    (11, 3.13, 0.71, 40),    # hybrid model fields (sgl-project/sglang#30047)
    (12, 1.00, 0.11, 48),    # python logging format (mit-han-lab/fastrl#4)
])
def test_sglang_decode_lines_of_several_releases(lineno, accept_len, rate, running):
    line = read("sglang_decode_lines.log").splitlines()[lineno - 1]
    parsed = parse_sglang_decode_line(line)
    assert (parsed.accept_len, parsed.accept_rate, parsed.running_requests) == (accept_len, rate, running)


def test_lines_without_speculation_do_not_parse():
    lines = read("sglang_decode_lines.log").splitlines()
    assert [n + 1 for n, line in enumerate(lines) if parse_sglang_decode_line(line) is None] == [1, 7, 9, 13, 14]


def test_sglang_log_slice_is_weighted_by_throughput():
    lines = read("sglang_decode_lines.log").splitlines()[:6]  # one request of sgl-project/sglang#11948
    acc = acceptance_from_sglang_log(lines, k=3)
    rows = [(2.17, 0.39), (1.95, 178.86), (1.80, 165.41), (2.05, 188.68), (1.80, 165.59)]
    assert acc.tau == pytest.approx(sum(a * w for a, w in rows) / sum(w for _, w in rows))
    assert acc.per_position == () and acc.source == "sglang-log"
    assert acceptance_from_sglang_log(lines[-1:] + ["unrelated"]) is not None
    assert acceptance_from_sglang_log(["no decode line here"]) is None
