"""`draftsmith run` with a DFlash drafter (train.family: dflash), and the guard as a verb and in the report.

Unit tier: the config refuses keys that disagree with the family before any stage (draft lengths past the block,
EAGLE-3-only settings, a starting drafter of the other family, formats and engines without DFlash); overrides are
checked together; the stages hand the engines the family (vLLM's method, llama-server's --spec-type, check's and
the guard's speculative config); a DFlash export carries its expected acceptance; the report lists the guard.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

from dflash_fixtures import write_dflash
from draftsmith.errors import DraftsmithError
from draftsmith.run.settings import RunConfig, load_config, resolve_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DFLASH = ["train.family=dflash", "train.mask_token_id=16", "train.block_size=8", "train.init_from=null"]


def refusal(*overrides: str) -> DraftsmithError:
    with pytest.raises(DraftsmithError) as err:
        resolve_config([*DFLASH, *overrides], None)
    text = err.value.render()
    assert all(part in text for part in ("got:", "expected:", "fix:")), text
    return err.value


def test_the_dflash_config_is_consistent_and_overrides_are_checked_together():
    cfg = load_config(CONFIGS / "dflash.yaml")
    most = cfg.train.block_size - 1
    assert cfg.train.family == "dflash" and cfg.train.mask_token_id == 16
    assert max(cfg.bench.k + cfg.bench.llamacpp_k + cfg.eval.k) <= most
    # the family before its mask token, in one command: checked once all are set
    assert resolve_config(["train.family=dflash", "train.mask_token_id=16"], None).train.family == "dflash"
    with pytest.raises(DraftsmithError, match="needs a mask token"):
        resolve_config(["train.family=dflash"], None)


@pytest.mark.parametrize("override, named", [
    ("bench.k=3,8", "bench.k [3, 8]: a DFlash block of train.block_size 8 drafts at most 7"),
    ("bench.llamacpp_k=9", "bench.llamacpp_k [9]"),
    ("eval.k=8", "eval.k [8]"),
    ("export.k=12", "export.k [12]"),
    ("train.draft_vocab_size=2048", "train.draft_vocab_size 2048: an EAGLE-3 setting"),
    ("train.ttt_steps=7", "train.ttt_steps 7"),
    ("train.recipe=normed", "train.recipe 'normed'"),
    ("export.formats=vllm,sglang", "export.formats: sglang has no DFlash writer"),
    ("eval.topk=2", "eval.topk / eval.draft_tokens"),
    ("capture.engine=vllm", "capture.engine: vllm captures EAGLE-3's three layers"),
])
def test_keys_that_do_not_fit_a_dflash_run_are_refused_before_the_first_stage(override, named):
    err = refusal(override)
    assert named in err.got, err.got


def test_a_starting_drafter_of_the_other_family_is_refused(tmp_path):
    err = refusal("train.init_from=smollm2")  # the shipped drafter is EAGLE-3's
    assert "train.init_from: smollm2 is a eagle3 drafter, train.family is dflash" in err.got
    dflash = write_dflash(tmp_path / "d", layers=1)
    with pytest.raises(DraftsmithError) as eagle:
        resolve_config([f"train.init_from={dflash}"], None)
    assert f"train.init_from: {dflash} is a dflash drafter, train.family is eagle3" in eagle.value.got
    assert resolve_config([*DFLASH[:3], f"train.init_from={dflash}"], None).train.init_from == str(dflash)


def test_the_stages_name_the_family_to_every_engine(tmp_path, monkeypatch):
    from draftsmith.engines import llamacpp
    from draftsmith.engines.process import VllmServe
    from draftsmith.run import stages

    cfg = resolve_config([*DFLASH, "bench.k=3,7"], str(tmp_path))
    with contextlib.ExitStack() as stack:
        ctx = stages.RunContext(cfg, tmp_path, Path(sys.executable), stack)
        spec = json.loads(ctx.speculative_config(7))
        assert spec == {"method": "dflash", "model": str(tmp_path / "export-vllm"), "num_speculative_tokens": 7}
        started = []
        monkeypatch.setattr("draftsmith.engines.llamacpp.serve", lambda s, log: started.append(s) or
                            contextlib.nullcontext("http://x"))
        with stages.llamacpp_server(stages.GgufPair(Path("t.gguf"), Path("d.gguf")), 7, tmp_path / "l.log", ctx.family):
            pass
    cmd = started[0].command(Path("llama-server"))
    assert cmd[cmd.index("--spec-type") + 1] == "draft-dflash" and cmd[cmd.index("--spec-draft-n-max") + 1] == "7"
    eagle = llamacpp.LlamaServe(Path("t"), Path("d")).command(Path("s"))
    assert eagle[eagle.index("--spec-type") + 1] == "draft-eagle3"
    vllm = VllmServe(Path("t"), Path("d"), 7, method=ctx.family).command(Path("python"))
    assert json.loads(vllm[vllm.index("--speculative-config") + 1])["method"] == "dflash"


def test_a_dflash_export_carries_its_expected_acceptance(tmp_path):
    from draftsmith.bench.guard import read_expected_dir
    from draftsmith.export.formats import export

    src = write_dflash(tmp_path / "d", layers=1)
    config = json.loads((src / "config.json").read_text())
    # the trainer's held-back eval: expected accepted length of a block drafting k tokens
    config["draftsmith"]["eval"] = {"acc": [0.7, 0.5, 0.4], "loss": 2.0, "tau": {"1": 1.7, "2": 2.1, "3": 2.3}}
    (src / "config.json").write_text(json.dumps(config))
    out = export(src, tmp_path / "vllm", "vllm", "float32", 3)
    expected = read_expected_dir(out, 3)
    assert expected is not None and expected.k == 3
    assert expected.per_position == pytest.approx((0.7, 0.4, 0.2))
    assert json.loads((out / "config.json").read_text())["draftsmith"]["expected_acceptance"]["k"] == 3


def test_the_guard_is_a_verb_and_says_when_the_engine_is_not_there(capsys):
    from draftsmith.cli import VERBS, main

    assert "guard" in VERBS
    with pytest.raises(SystemExit):
        main(["guard", "--help"])
    assert "--spec-type draft-eagle3" in capsys.readouterr().out
    spec = json.dumps({"method": "dflash", "model": "/nowhere", "num_speculative_tokens": 3})
    assert main(["guard", "--url", "http://127.0.0.1:9", "--", "vllm", "serve", "t", "--speculative-config", spec]) == 2
    assert "the engine does not answer" in capsys.readouterr().err


def test_the_report_lists_the_guard_stage_and_its_verdict(tmp_path):
    from draftsmith.run.report import write_report

    (tmp_path / "run_config.json").write_text(json.dumps({"target": "smollm2", **json.loads(
        RunConfig().model_dump_json())}))
    (tmp_path / "summary.json").write_text(json.dumps({"stages": {"launch": "ran", "guard": "ran"},
                                                       "stage_seconds": {"guard": 21.0}}))
    (tmp_path / "launch.json").write_text(json.dumps({"status": "ready", "ready_s": 60.0, "log": "launch.log"}))
    (tmp_path / "guard.json").write_text(json.dumps({
        "state": "degraded", "exit_code": 6, "reasons": ["position 0 accepts 0.40 against 0.68 expected"],
        "measured": {"per_position": [0.4, 0.2], "drafts": 90}, "expected": {"per_position": [0.68, 0.45]},
        "causes": [{"rule": "vllm.aux-mismatch", "cause": "aux ids differ", "fix": "export again"}], "seconds": 21.0}))
    md = write_report(tmp_path).read_text()
    assert "| guard | ran | 21 |" in md
    assert ("Guard: **degraded**: acceptance per position 0.40 0.20 over 90 drafts, expected 0.68 0.45; position 0 "
            "accepts 0.40 against 0.68 expected; first candidate cause: aux ids differ (fix: export again)") in md
    assert json.loads((tmp_path / "report.json").read_text())["guard"]["state"] == "degraded"


def test_the_guards_candidate_causes_for_a_dflash_deployment_name_its_own_layers_and_attention(tmp_path):
    from draftsmith.export.formats import export
    from draftsmith.preflight.guard import Deployment, candidate_causes

    out = export(write_dflash(tmp_path / "d", layers=1), tmp_path / "vllm", "vllm", "float32", 3)
    spec = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": 3})
    causes = candidate_causes(Deployment("vllm", "smollm2", out, 3, spec, None, "--dtype float32"))
    assert [c["rule"] for c in causes] == ["unnamed.capture", "unnamed.causal", "unnamed.target"], causes
    assert "dflash_config.target_layer_ids" in causes[0]["fix"] and "non-causal" in causes[1]["fix"]
    # a stray EAGLE id list makes vLLM read other layers: check names it, first
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4, 5]}))
    named = candidate_causes(Deployment("vllm", "smollm2", out, 3, spec, None, "--dtype float32"))
    assert named[0]["severity"] in ("error", "warning") and named[0]["rule"].startswith("vllm-dflash"), named


def test_runs_guard_holds_the_engine_to_this_runs_eval_on_its_prompts(tmp_path):
    from draftsmith.run import stages

    cfg = resolve_config([*DFLASH, "eval.prompts=eval", "eval.limit=4", "eval.max_new_tokens=48", "eval.k=3,7"],
                         str(tmp_path))
    with contextlib.ExitStack() as stack:
        ctx = stages.RunContext(cfg, tmp_path, None, stack)
        assert stages.guard_reference(ctx, 7) == {}  # no eval yet: the export's expectation, the guard's prompts
        rows = [{"k": k, "tau": 1 + sum(pp), "per_position": pp, "verify_steps": 128, "topk": 1}
                for k, pp in ((3, [0.38, 0.09, 0.02]), (7, [0.38, 0.08, 0.02, 0, 0, 0, 0]))]
        (tmp_path / "eval.json").write_text(json.dumps({"sweep": rows, "settings": cfg.eval.record()}))
        ref = stages.guard_reference(ctx, 7)
        assert stages.guard_reference(ctx, 5) == {}  # eval did not measure the served k
    assert (ref["prompts"], ref["requests"], ref["max_tokens"]) == ("eval", 4, 48)
    assert ref["expected"].per_position == (0.38, 0.08, 0.02, 0, 0, 0, 0) and ref["expected"].k == 7
    assert ref["expected"].measured_on["method"].startswith("draftsmith eval")


def test_a_guard_rerun_after_its_launch_finished_starts_launchs_server_again(tmp_path, monkeypatch):
    from draftsmith.preflight import guard
    from draftsmith.run import stages

    cfg = resolve_config([*DFLASH, "bench.k=3,7"], str(tmp_path))
    launched, measured = [], []

    def launch(ctx):
        launched.append(ctx.engine_ks()[-1])
        ctx.launched = stages.Served(7, "http://relaunched", contextlib.ExitStack())

    def run_guard(url, dep, **kw):
        measured.append((url, json.loads(dep.speculative_config)["method"], dep.k))
        raise DraftsmithError("stop here", got="", expected="", fix="")

    monkeypatch.setattr(stages, "do_launch", launch)
    monkeypatch.setattr(guard, "run_guard", run_guard)
    with contextlib.ExitStack() as stack, pytest.raises(DraftsmithError, match="stop here"):
        stages.do_guard(stages.RunContext(cfg, tmp_path, Path(sys.executable), stack))
    assert launched == [7] and measured == [("http://relaunched", "dflash", 7)]
