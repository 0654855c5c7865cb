"""llama.cpp: the GGUF export, `check --engine llamacpp`, and the drafter served by a real `llama-server`.

Unit tier: aux-id placement and the facts `check` derives from config.json or a GGUF header (tiny target,
GGUFs written with the `gguf` package); the real `/metrics` text a llama-server produced (fixture).
e2e tier: llama.cpp's own converter (from the sdist `make llama-server` unpacks) on a drafter trained on
non-default layers. Engine tier (run it under `flock /tmp/draftsmith-engine.lock`): SmolLM2 with the
exported drafter in llama-server, f32 target and drafter: lossless greedy, acceptance against
`draftsmith eval`, and `draftsmith bench` reading llama.cpp's counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.engines import llamacpp
from draftsmith.preflight import check
from draftsmith.preflight.check import CheckSettings
from draftsmith.errors import DraftsmithError
from draftsmith.bench.metrics import acceptance_from_counters, parse_spec_counters

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
TRAINED = (1, 4, 6)  # non-default boundary ids for the 8-layer tiny target (its default is (2, 4, 5))


def tiny_drafter(path: Path, target: Path, aux: tuple[int, ...] = TRAINED, engine: str = "vllm", **norms) -> Path:
    """A drafter for the tiny target, saved by `save_drafter` (ids in `eagle_config`, vLLM's place); `norms`:
    DrafterConfig's norm variants."""
    from draftsmith.model.checkpoint import save_drafter
    from draftsmith.model.eagle3 import DrafterConfig, Eagle3Drafter
    from draftsmith.model.vocab import build_draft_vocab

    cfg_t = json.loads((target / "config.json").read_text())
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=cfg_t["vocab_size"], draft_vocab_size=48, target_hidden_size=cfg_t["hidden_size"],
                        target_num_layers=cfg_t["num_hidden_layers"], aux_layer_ids=aux, **norms)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    vocab = build_draft_vocab(torch.arange(cfg.vocab_size, 0, -1), 48)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    return save_drafter(drafter, path, engine=engine, extra={"target": str(target)})


def write_gguf(path: Path, target_layers: list[int], arch: str = "eagle3") -> Path:
    """A header-complete drafter GGUF with only the fields `llamacpp.read_gguf` reads."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_array(f"{arch}.target_layers", target_layers)
    w.add_uint32(f"{arch}.target_hidden_size", 64)
    w.add_tensor("d2t", np.arange(48, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rules(findings, severity: str) -> set[str]:
    return {f.rule for f in findings if f.severity == severity}


# ---------------------------------------------------------------- unit: where the ids go, what check sees

def test_the_vllm_layout_carries_top_level_ids_that_the_converter_reads_as_trained(tmp_path, tiny_target):
    drafter = tiny_drafter(tmp_path / "d", tiny_target)
    findings, facts = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    # conversion/llama.py:74-82 reads only the top-level ids (without them it writes [2, L//2, L-3]); the vllm
    # layout writes them there too (for vLLM 0.11.1-0.21.0), so the converter finds the trained layers
    assert facts["aux_engine_reads"] == facts["aux_trained"] == list(TRAINED) != [2, 4, 5]
    assert "llamacpp.aux-mismatch" in rules(findings, "ok")
    assert "llamacpp.aux-eagle-config-only" not in rules(findings, "warning")
    assert "llamacpp.no-gguf" in rules(findings, "warning")
    config = json.loads((drafter / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids")  # a vllm-layout drafter from before: eagle_config only
    (drafter / "config.json").write_text(json.dumps(config))
    findings, facts = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    assert facts["aux_engine_reads"] == [2, 4, 5]
    assert "llamacpp.aux-mismatch" in rules(findings, "error")
    assert "llamacpp.aux-eagle-config-only" in rules(findings, "warning")


def test_the_llamacpp_config_puts_the_trained_ids_on_top_and_check_passes(tmp_path, tiny_target):
    drafter = tiny_drafter(tmp_path / "d", tiny_target)
    config = llamacpp.llamacpp_config(json.loads((drafter / "config.json").read_text()))
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TRAINED)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(TRAINED)
    assert config["draftsmith"]["aux_id_convention"] == "llamacpp"
    (drafter / "config.json").write_text(json.dumps(config))
    findings, facts = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    assert facts["aux_engine_reads"] == list(TRAINED)
    assert rules(findings, "error") == set()
    assert "llamacpp.aux-mismatch" in rules(findings, "ok")


def test_a_gguf_in_the_directory_is_what_check_believes(tmp_path, tiny_target):
    drafter = tiny_drafter(tmp_path / "d", tiny_target)
    config = llamacpp.llamacpp_config(json.loads((drafter / "config.json").read_text()))
    (drafter / "config.json").write_text(json.dumps(config))
    write_gguf(drafter / "drafter-f32.gguf", [2, 4, 5])  # converted before the ids were fixed
    meta = llamacpp.read_gguf(drafter / "drafter-f32.gguf")
    assert (meta.arch, meta.target_layers, meta.draft_vocab_size) == ("eagle3", (2, 4, 5), 48)
    findings, facts = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    assert facts["aux_engine_reads"] == [2, 4, 5] and "GGUF" in facts["llamacpp_aux_source"]
    assert "llamacpp.aux-mismatch" in rules(findings, "error")


def test_two_aux_layers_or_a_plain_llama_gguf_will_not_load(tmp_path, tiny_target):
    drafter = tiny_drafter(tmp_path / "d", tiny_target)
    write_gguf(drafter / "a.gguf", [2, 4])
    findings, _ = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    assert "llamacpp.aux-count" in rules(findings, "error")
    (drafter / "a.gguf").unlink()
    write_gguf(drafter / "a.gguf", [1, 4, 6], arch="llama")
    findings, _ = check.run_checks(tiny_target, drafter, CheckSettings(engine="llamacpp", engine_version="0.3.36"))
    assert "llamacpp.gguf-arch" in rules(findings, "error")
    config = json.loads((drafter / "config.json").read_text())
    config["draftsmith"]["aux_layer_ids_boundary"] = [2, 4]
    with pytest.raises(DraftsmithError, match="exactly three"):
        llamacpp.llamacpp_config(config)


def test_spec_flags_that_break_the_comparison_are_flagged(tmp_path, tiny_target):
    drafter = tiny_drafter(tmp_path / "d", tiny_target)
    findings, _ = check.run_checks(tiny_target, drafter,
        CheckSettings(engine="llamacpp", engine_version="0.3.36",
                      engine_args="--spec-type draft-simple --spec-draft-p-min 0.5"))
    assert {"llamacpp.spec-type", "llamacpp.p-min"} <= rules(findings, "warning")


def test_server_command_drafts_up_to_k_on_loopback_with_metrics():
    cmd = llamacpp.LlamaServe(Path("t.gguf"), Path("d.gguf"), k=5, port=1234).command(Path("llama-server"))
    text = " ".join(cmd)
    for part in ("--host 127.0.0.1", "-md d.gguf", "--spec-type draft-eagle3", "--spec-draft-n-max 5",
                 "--spec-draft-n-min 0", "--metrics"):
        assert part in text, part
    assert "-md" not in llamacpp.LlamaServe(Path("t.gguf")).command(Path("llama-server"))
    fixed = llamacpp.LlamaServe(Path("t.gguf"), Path("d.gguf"), k=5, p_min=0.0).command(Path("llama-server"))
    assert fixed[fixed.index("--spec-draft-p-min") + 1] == "0" and fixed[fixed.index("--spec-draft-n-max") + 1] == "5"


def test_draftsmith_serves_with_the_measured_draft_cut_off_and_measures_tau_without_it():
    """The cut-off that measured faster on this CPU (SERVE_P_MIN, docs/eval.md) is what LlamaServe and the exported
    serve command use; 0, for tau at a fixed k, only when asked."""
    assert 0 < llamacpp.SERVE_P_MIN < 1
    served = llamacpp.LlamaServe(Path("t.gguf"), Path("d.gguf")).command(Path("llama-server"))
    assert float(served[served.index("--spec-draft-p-min") + 1]) == llamacpp.SERVE_P_MIN
    exported = llamacpp.serve_command("t.gguf", "d.gguf", 3)
    assert float(exported[exported.index("--spec-draft-p-min") + 1]) == llamacpp.SERVE_P_MIN
    card = llamacpp.model_card(Path("out"), "drafter-f32.gguf", "t.gguf", [2, 15, 27], 3, True)
    assert f"--spec-draft-p-min {llamacpp.SERVE_P_MIN:g}" in card and "--spec-draft-p-min 0`" in card


def test_server_command_ends_with_the_extra_flags():
    cmd = llamacpp.LlamaServe(Path("t.gguf"), Path("d.gguf"), extra_args=("-lv", "4")).command(Path("llama-server"))
    assert cmd[-2:] == ["-lv", "4"] and "--spec-draft-p-min" in cmd


# Real `timings` of llama-server (0.3.36, SmolLM2 q8_0, shipped drafter, k=3): a 64-token generation after a
# cached 199-token prefix, and a prompt extension by 4 tokens on the plain server (no draft fields then).
SPEC_TIMINGS = {"cache_n": 199, "prompt_n": 1, "prompt_ms": 8.294, "prompt_per_token_ms": 8.294,
                "prompt_per_second": 120.56908608632746, "predicted_n": 64, "predicted_ms": 539.134,
                "predicted_per_token_ms": 8.55768253968254, "predicted_per_second": 116.85406596504764,
                "draft_n": 63, "draft_n_accepted": 41}
EXTENSION_TIMINGS = {"cache_n": 200, "prompt_n": 4, "prompt_ms": 17.384, "prompt_per_token_ms": 4.346,
                     "prompt_per_second": 230.09664058904738, "predicted_n": 1, "predicted_ms": 0.001,
                     "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def test_timings_count_the_target_forwards_of_a_generation():
    t = llamacpp.parse_timings({"timings": SPEC_TIMINGS})
    assert (t.predicted_n, t.draft_n, t.draft_n_accepted) == (64, 63, 41)
    # 63 tokens after the first (which the prompt's logits give): 41 came as accepted drafts, 22 from forwards
    assert t.target_steps == 22
    ext = llamacpp.parse_timings({"timings": EXTENSION_TIMINGS})
    assert (ext.cache_n, ext.prompt_n, ext.prompt_ms, ext.draft_n, ext.target_steps) == (200, 4, 17.384, 0, 0)


def test_a_response_without_timings_names_the_missing_fields():
    with pytest.raises(DraftsmithError, match="timings") as err:
        llamacpp.parse_timings({"content": "hi", "timings": {"prompt_n": 3}})
    assert "predicted_ms" in str(err.value)


def test_real_llama_server_metrics_parse_to_the_shared_definition():
    """Captured from llama-server (llama-cpp-python 0.3.36) serving SmolLM2 with an EAGLE-3 drafter, k=3."""
    before = parse_spec_counters((FIXTURES / "llamacpp_spec_before.prom").read_text())
    after = parse_spec_counters((FIXTURES / "llamacpp_spec_after.prom").read_text())
    assert before[0] == after[0] == "llamacpp"
    window = after[1].minus(before[1])
    acc = acceptance_from_counters(window, "llamacpp")
    assert acc.num_speculative_tokens == 3 and window.drafts > 0
    assert sum(window.accepted_per_pos) == window.accepted  # each accepted token counted at its position
    assert acc.tau == pytest.approx(1 + window.accepted / window.drafts)


# ---------------------------------------------------------------- e2e: llama.cpp's own converter

@pytest.mark.e2e
def test_the_converter_writes_the_trained_layers_only_through_the_llamacpp_export(tmp_path):
    from draftsmith.export.formats import export
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    drafter = tiny_drafter(tmp_path / "d", target, aux=(1, 10, 20))
    (tmp_path / "user-target.gguf").write_bytes(b"")  # the user's own target GGUF: recorded, not converted
    out = export(drafter, tmp_path / "gguf", "llamacpp", "float32", 3, str(target),
                 target_gguf=str(tmp_path / "user-target.gguf"))
    meta = llamacpp.read_gguf(out / "drafter-f32.gguf")
    assert (meta.arch, meta.target_layers, meta.target_hidden_size) == ("eagle3", (1, 10, 20), 576)
    manifest = json.loads((out / "llamacpp.json").read_text())
    assert manifest["target_gguf_converted"] is False and manifest["target_layers"] == [1, 10, 20]
    # the same drafter in the vLLM layout, converted as llama.cpp documents it: the top-level ids keep the layers
    export(drafter, tmp_path / "vllm", "vllm", "float32", 3, str(target))
    plain = llamacpp.convert(tmp_path / "vllm", tmp_path / "plain.gguf", "f32", target)
    assert llamacpp.read_gguf(plain).target_layers == (1, 10, 20)
    # ... which a vLLM-layout config with the ids in eagle_config only (exports before 2026-12-01) loses
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids")
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    plain = llamacpp.convert(tmp_path / "vllm", tmp_path / "plain-old.gguf", "f32", target)
    assert llamacpp.read_gguf(plain).target_layers == (2, 15, 27)


@pytest.mark.e2e
def test_the_normed_recipes_norms_reach_the_gguf_llama_cpp_computes(tmp_path):
    """The normed recipe (train.RECIPES) serves in llama.cpp: its two norms arrive as the header flags and the
    input-norm tensor that llama.cpp's eagle3 graph reads
    (benchmarks/results/peer_engines_parity_normed_chat-eval.json: tau 1.650 there against the reference decoder's
    1.661)."""
    from gguf import GGUFReader

    from draftsmith.export.formats import export
    from draftsmith.target import resolve_target
    from draftsmith.train.settings import RECIPES

    target = resolve_target("smollm2")
    normed = RECIPES["normed"]
    drafter = tiny_drafter(tmp_path / "d", target, norm_before_fc=normed.norm_before_fc,
                           norm_before_residual=normed.norm_before_residual, norm_output=normed.norm_output)
    (tmp_path / "user-target.gguf").write_bytes(b"")  # recorded, not converted
    out = export(drafter, tmp_path / "gguf", "llamacpp", "float32", 3, str(target),
                 target_gguf=str(tmp_path / "user-target.gguf"))
    meta = llamacpp.read_gguf(out / "drafter-f32.gguf")
    assert (meta.norm_before_fc, meta.norm_before_residual) == (True, True)
    names = {t.name for t in GGUFReader(str(out / "drafter-f32.gguf")).tensors}
    assert "enc.output_norm.weight" in names, sorted(names)


# ---------------------------------------------------------------- engine: a real llama-server

def greedy(base: str, prompts: list[list[int]], max_tokens: int) -> list[llamacpp.Completion]:
    return [llamacpp.complete(base, ids, max_tokens) for ids in prompts]


def scrape(base: str):
    import urllib.request

    return parse_spec_counters(urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())


@pytest.mark.engine
def test_llama_server_serves_the_exported_drafter_losslessly_with_the_acceptance_eval_predicts(small_run, tmp_path):
    from conftest import E2E_K, ENGINE_MAX_TOKENS, ENGINE_PROMPTS, target_greedy_texts
    from transformers import AutoTokenizer

    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.eval.evaluation import EvalSettings, run_eval
    from draftsmith.export.formats import export
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    out = export(small_run / "train" / "drafter", tmp_path / "gguf", "llamacpp", "float32", E2E_K, str(target))
    manifest = json.loads((out / "llamacpp.json").read_text())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts("eval", ENGINE_PROMPTS)]
    tgt = Path(manifest["target_gguf"])
    with llamacpp.serve(llamacpp.LlamaServe(tgt), tmp_path / "plain.log") as base:
        plain = greedy(base, prompts, ENGINE_MAX_TOKENS)
    spec = llamacpp.LlamaServe(tgt, out / manifest["drafter_gguf"], k=E2E_K, p_min=0.0)  # k-token drafts, as eval
    with llamacpp.serve(spec, tmp_path / "spec.log") as base:
        before = scrape(base)
        served = greedy(base, prompts, ENGINE_MAX_TOKENS)
        after = scrape(base)
        r = subprocess.run([sys.executable, "-m", "draftsmith.cli", "bench", "--endpoint", base, "--num-prompts", "2",
                            "--concurrency", "1", "--max-tokens", "32", "--warmup", "0", "--json"],
                           capture_output=True, text=True, timeout=900)
    assert llamacpp.read_gguf(out / manifest["drafter_gguf"]).target_layers == (2, 15, 27)
    # (a) lossless: with the drafter, exactly llama-server's own greedy tokens, and the same text as
    # draftsmith's transformers reference (fp32 weights on both sides: the target GGUF is f32)
    assert [c.tokens for c in served] == [c.tokens for c in plain]
    texts = [tok.decode(c.tokens, skip_special_tokens=True).strip() for c in served]
    assert texts == [t.strip() for t in target_greedy_texts()]
    # llama.cpp's two reports agree with each other: per-response timings and the Prometheus counters
    window = after[1].minus(before[1])
    assert window.drafts > 0, "llama-server ran no drafts: the drafter was not used"
    assert sum(c.timings.draft_n for c in served) == window.draft_tokens
    assert sum(c.timings.draft_n_accepted for c in served) == window.accepted
    tau_llamacpp = acceptance_from_counters(window, "llamacpp").tau
    # (b) parity with draftsmith eval on the same prompts, k and length. Both count accepted drafts + 1 per
    # verification over the same greedy tokens; they can differ only where the drafter's argmax is a
    # near-tie that f32 kernels round differently, and in the last tokens before max_tokens, where
    # llama.cpp shortens the draft to the tokens left (server-context.cpp:463-466). 0.25 in tau is under a
    # tenth of the gap between a working drafter and a misread one (tau 1.0); the same bound as vLLM's test.
    [ours] = run_eval("smollm2", small_run / "train" / "drafter",
                      EvalSettings(prompts="eval", k=(E2E_K,), limit=ENGINE_PROMPTS, temperature=0.0,
                                   max_new_tokens=ENGINE_MAX_TOKENS, engine="vllm", dtype="float32", baseline=True, seed=0))
    assert abs(tau_llamacpp - ours.tau) <= 0.25, (tau_llamacpp, ours.tau)
    # bench reads the same counters (its own window over its own requests)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["acceptance"]["source"] == "llamacpp", report["acceptance"]
    assert report["acceptance"]["drafts"] > 0
    (tmp_path / "parity.json").write_text(json.dumps({"tau_llamacpp": tau_llamacpp, "tau_eval": ours.tau}))
    print(f"parity: tau llama.cpp {tau_llamacpp:.3f} vs draftsmith eval {ours.tau:.3f} (k={E2E_K})")


@pytest.mark.engine
def test_runs_bench_serves_the_drafter_in_llama_server_at_each_k_and_keeps_the_measured_best(tmp_path):
    """run's bench stage without vLLM (no interpreter): the shipped drafter exported to GGUF, one plain llama-server
    and one speculative server per bench.llamacpp_k (run's defaults), bench/llamacpp.json with the chosen k, and
    the report's llama.cpp verdict, headline and section."""
    import contextlib
    import shutil
    import time

    from draftsmith.bench.verdict import SPEEDUP_FLOOR
    from draftsmith.model.checkpoint import drafter_path
    from draftsmith.run.report import headline, write_report
    from draftsmith.run.settings import plain, resolve_config
    from draftsmith.run.stages import RunContext, do_bench

    llamacpp.server_binary()  # fails (does not skip) when llama-server is not built
    run = tmp_path / "run"
    shutil.copytree(drafter_path("smollm2"), run / "train" / "drafter")
    cfg = resolve_config([], str(run))
    (run / "run_config.json").write_text(json.dumps(plain(cfg)))
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        do_bench(RunContext(cfg, run, None, stack))
    print(f"llama.cpp part of bench: {time.perf_counter() - start:.0f} s")
    assert not (run / "bench" / "bench.json").exists(), "vLLM was measured without its interpreter"
    result = json.loads((run / "bench" / "llamacpp.json").read_text())
    chosen = result["sweep"]["choice"]["k"]
    assert [row["k"] for row in result["sweep"]["rows"]] == list(cfg.bench.llamacpp_k)
    assert chosen in cfg.bench.llamacpp_k
    assert result["settings"]["num_speculative_tokens"] == chosen and result["p_min"] == llamacpp.SERVE_P_MIN
    for k in cfg.bench.llamacpp_k:  # each k served at its own k, measured at batch 1 against the plain server
        per_k = json.loads((run / "bench" / "llamacpp" / f"k{k}.json").read_text())
        assert per_k["settings"]["num_speculative_tokens"] == k and per_k["acceptance"]["source"] == "llamacpp"
        assert per_k["acceptance"]["drafts"] > 0 and per_k["tau"] > 1.0, f"llama-server accepted no draft at k={k}"
        assert len(per_k["per_position"]) == k
        [level] = per_k["levels"]
        assert level["concurrency"] == 1 and level["failed"] == 0 and level["baseline_output_tokens_per_s"] > 0
        assert level["requests"] == cfg.bench.llamacpp_num_prompts
        assert len(level["rounds_tokens_per_s"]) == cfg.bench.rounds
        assert (run / "bench" / "llamacpp" / f"speculative-k{k}.log").stat().st_size > 0
    assert (run / "bench" / "llamacpp" / "baseline.log").stat().st_size > 0
    assert Path(result["drafter_gguf"]).parent == run / "export-llamacpp"
    still = subprocess.run(["pgrep", "-f", str(run / "export-llamacpp")], capture_output=True, text=True).stdout
    assert not still.strip(), "a llama-server of this run is still running"
    write_report(run)
    doc = json.loads((run / "report.json").read_text())
    assert doc["verdict"]["source"] == "bench: llama.cpp with and without the drafter"
    speedup, faster = result["levels"][0]["speedup"], result["verdict"]["decision"] == "go"
    assert doc["verdict"]["decision"] == ("go" if faster and speedup > SPEEDUP_FLOOR else "no-go")
    choice = doc["k_choice"][-1]
    assert (choice["engine"], choice["k"]) == ("llama.cpp", chosen)
    assert result["sweep"]["choice"]["reason"] in choice["why"]
    assert f"llama.cpp speed-up {speedup:.2f}x at k={chosen}" in headline(doc)
    assert "## llama.cpp" in (run / "report.md").read_text()
    print(headline(doc))
