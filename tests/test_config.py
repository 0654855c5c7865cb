"""The one config system: run's sections are the verbs' models, unknown keys get a suggestion, docs stay generated."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from draftsmith.config import add_flags, from_flags, from_mapping
from draftsmith.errors import DraftsmithError
from draftsmith.eval.evaluation import EvalSettings
from draftsmith.run.settings import RUN_TRAIN_DEFAULTS, RunConfig
from draftsmith.train.settings import TrainConfig, TrainSettings

ROOT = Path(__file__).resolve().parents[1]


def test_run_train_section_is_the_train_verbs_settings_with_only_the_named_defaults_changed():
    section = type(RunConfig().train)
    assert issubclass(section, TrainSettings) and issubclass(TrainConfig, TrainSettings)
    assert set(section.model_fields) - set(TrainSettings.model_fields) == {"mode"}
    changed = {k for k in TrainSettings.model_fields
               if section.model_fields[k].default != TrainSettings.model_fields[k].default}
    assert changed == set(RUN_TRAIN_DEFAULTS)
    assert all(section.model_fields[k].description == TrainSettings.model_fields[k].description
               for k in TrainSettings.model_fields)


def test_run_eval_section_is_the_eval_verbs_settings():
    assert isinstance(RunConfig().eval, EvalSettings)
    assert set(type(RunConfig().eval).model_fields) == set(EvalSettings.model_fields)


def test_verb_flags_come_from_the_model_and_convert_through_it():
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainConfig)
    args = parser.parse_args(["--out", "o", "--store", "s", "--lr", "3e-4", "--no-pack", "--aux-ids", "2,15,27"])
    cfg = from_flags(TrainConfig, args)
    assert (cfg.lr, cfg.pack, cfg.aux_ids, cfg.epochs) == (3e-4, False, (2, 15, 27), 1.0)
    assert "Peak learning rate" in parser.format_help()


def test_an_unknown_key_of_a_verb_model_is_named_with_a_suggestion():
    with pytest.raises(DraftsmithError) as err:
        from_mapping(TrainConfig, {"out": "o", "store": "s", "warmup_ration": 0.1})
    assert "did you mean warmup_ratio?" in err.value.render()


def test_several_bad_values_are_reported_together():
    with pytest.raises(DraftsmithError) as err:
        from_mapping(EvalSettings, {"limit": "many", "max_new_tokens": "lots"})
    assert "limit" in err.value.render() and "max_new_tokens" in err.value.render()


def test_the_docs_key_table_is_the_generated_one():
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_keys import DOC, with_table

    text = DOC.read_text()
    assert with_table(text) == text, "docs/run.md's key table is stale: run scripts/docs_keys.py"


# ---------------------------------------------------------------- every verb: flags, defaults and run's section, one model

from draftsmith.bench.benchmark import BenchSettings  # noqa: E402
from draftsmith.preflight.check import CheckSettings, EngineFlags  # noqa: E402
from draftsmith.cli import build_parser, main  # noqa: E402
from draftsmith.export.formats import ExportSettings  # noqa: E402
from draftsmith.engines.launch import LaunchSettings  # noqa: E402
from draftsmith.regenerate.command import RegenerateSettings  # noqa: E402
from draftsmith.capture.local import CaptureSettings  # noqa: E402
from draftsmith.export.convert import ConvertSettings  # noqa: E402
from draftsmith.engines.diagnose import DiagnoseSettings  # noqa: E402
from draftsmith.capture.interop import ExportStoreSettings  # noqa: E402
from draftsmith.run.report import ReportSettings  # noqa: E402
from draftsmith.target import TargetSettings  # noqa: E402

# verb, its model, the arguments it requires, run's section (None: check, whose section lists engines)
VERBS = [("regenerate", RegenerateSettings, ["--out", "c.jsonl"], "regenerate"),
         ("bench", BenchSettings, ["--endpoint", "http://x"], "bench"),
         ("launch", LaunchSettings, [], "launch"),
         ("export", ExportSettings, ["src", "out"], "export"),
         ("check", CheckSettings, ["--target", "t", "--drafter", "d", "--engine", "vllm"], None),
         ("capture", CaptureSettings, [], "capture"),
         ("convert", ConvertSettings, ["src", "out", "--to", "vllm"], None),
         ("diagnose", DiagnoseSettings, ["no-such.log"], None),
         ("export-store", ExportStoreSettings, ["no-such-store", "out"], None),
         ("report", ReportSettings, ["no-such-run"], None),
         ("target", TargetSettings, ["no-such-target"], None)]
# the values of the fields `required` sets (check's engine, the positional paths)
REQUIRED_VALUES = {"check": {"engine": "vllm"}, "convert": {"src": Path("src"), "out": Path("out"), "to": "vllm"},
                   "diagnose": {"logfile": Path("no-such.log")},
                   "export-store": {"store": Path("no-such-store"), "out": Path("out")},
                   "report": {"run_dir": Path("no-such-run")}, "target": {"name": "no-such-target"}}
# a value each verb's model refuses, and a word of the fix it prints
BAD = {"regenerate": (["--decoder", "fast"], "--decoder auto"), "bench": (["--concurrency", "one"], "--concurrency 1"),
       "launch": (["--timeout", "0"], "--timeout 1800"), "export": (["--format", "onnx"], "--format vllm,sglang"),
       "check": (["--engine", "trt"], "--engine vllm"), "capture": (["--engine", "sglang"], "--engine transformers"),
       "convert": (["--to", "onnx"], "--to draftsmith"), "export-store": (["--format", "arrow"], "--format speculators"),
       # diagnose and report take a path and --json: the path that is not there is their bad value
       "diagnose": ([], "pass the file the engine's stdout"), "report": ([], "pass the --out of a run"),
       "target": ([], "fix:")}


def cli_settings(verb: str, model, argv: list[str]):
    """The verb's settings as its own command line builds them."""
    return from_flags(model, build_parser().parse_args([verb, *argv]))


def as_flags(values: dict) -> list[str]:
    argv = []
    for key, value in values.items():
        flag = {"timeout_s": "--timeout", "stall_timeout_s": "--stall-timeout", "formats": "--format",
                "tensor_parallel": "--tp", "as_json": "--json"}.get(
            key, "--" + key.replace("_", "-"))
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, "none" if value is None else ",".join(map(str, value)) if isinstance(value, tuple)
                     else str(value)]
    return argv


@pytest.mark.parametrize("verb,model,required,_", VERBS, ids=[v[0] for v in VERBS])
def test_a_verbs_command_line_defaults_are_its_models_defaults(verb, model, required, _):
    assert cli_settings(verb, model, required) == model(**REQUIRED_VALUES.get(verb, {}))


@pytest.mark.parametrize("verb,model,required,section", [v for v in VERBS if v[3]], ids=[v[0] for v in VERBS if v[3]])
def test_runs_section_is_the_verbs_model_and_the_same_values_on_the_command_line_give_the_same_settings(
        verb, model, required, section):
    run_section = getattr(RunConfig(), section)
    assert isinstance(run_section, model)
    changed = {k: getattr(run_section, k) for k in model.model_fields
               if type(run_section).model_fields[k].default != model.model_fields[k].default}
    assert changed, f"run's {section} section should differ from the verb somewhere (the CPU demo's sizes)"
    as_verb = model(**run_section.model_dump(include=set(model.model_fields)))
    assert cli_settings(verb, model, required + as_flags(changed)) == as_verb


def test_runs_check_section_shares_the_check_verbs_engine_flags():
    assert isinstance(RunConfig().check, EngineFlags) and issubclass(CheckSettings, EngineFlags)
    run = RunConfig().check.model_copy(update={"engine_args": "--tensor-parallel-size 8"})
    verb = cli_settings("check", CheckSettings, ["--target", "t", "--drafter", "d", "--engine", "vllm",
                                                 "--engine-args", "--tensor-parallel-size 8"])
    assert verb.engine_args == run.engine_args


@pytest.mark.parametrize("verb,model,required,_", VERBS, ids=[v[0] for v in VERBS])
def test_a_bad_value_on_a_verbs_command_line_is_a_what_got_expected_fix_error(verb, model, required, _, capsys):
    bad, fix = BAD[verb]
    assert main([verb, *required, *bad]) == 2
    err = capsys.readouterr().err
    assert all(part in err for part in ("got:", "expected:", "fix:", fix)), err


def test_a_bad_value_in_runs_section_is_refused_by_the_verbs_model():
    with pytest.raises(DraftsmithError, match="unknown --decoder"):
        from_mapping(RunConfig, {"regenerate": {"decoder": "fast"}})
    with pytest.raises(DraftsmithError, match="bad load levels"):
        from_mapping(RunConfig, {"bench": {"concurrency": [0, 4]}})


def test_a_verbs_help_shows_its_examples_and_its_fields_docs():
    for verb, model, _, _ in VERBS:
        subs = next(a for a in build_parser(verb)._actions if isinstance(a, argparse._SubParsersAction))
        help_text = " ".join(subs.choices[verb].format_help().split())
        assert f"draftsmith {verb} " in help_text.split("example", 1)[1], verb
        for name, field in model.model_fields.items():
            assert " ".join((field.description or "").split())[:30] in help_text, (verb, name)


def test_runs_capture_section_keeps_its_keys_and_differs_from_the_verb_only_in_length_and_dtype():
    run = RunConfig().capture
    assert set(type(run).model_fields) == set(CaptureSettings.model_fields)
    assert {k: v for k, v in run.model_dump().items() if v != getattr(CaptureSettings(), k)} == {
        "max_length": 1024, "dtype": "auto"}


def test_auto_capture_dtype_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    """run captures in `auto`: bf16 on CUDA and on AVX512-BF16 / AMX CPUs, float32 on an AVX2 CPU (emulated bf16)."""
    import torch

    from draftsmith.target import compute_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert compute_dtype("auto", "cpu") == "float32" and compute_dtype("auto", torch.device("cuda:1")) == "bfloat16"
    assert compute_dtype("bfloat16", "cpu") == "bfloat16" and compute_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert compute_dtype("auto", "cpu") == "bfloat16"


@pytest.mark.parametrize("model,values,typo,suggestion", [
    (CaptureSettings, {}, "hs_max_byte", "hs_max_bytes"),
    (ConvertSettings, {"src": "a", "out": "b", "to": "vllm"}, "drop_embedings", "drop_embeddings"),
    (DiagnoseSettings, {"logfile": "a.log"}, "as_jsno", "as_json"),
    (ExportStoreSettings, {"store": "a", "out": "b"}, "index_onyl", "index_only"),
    (ReportSettings, {"run_dir": "a"}, "as_jsno", "as_json"),
    (TargetSettings, {"name": "smollm2"}, "as_jsno", "as_json"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_an_unknown_key_of_the_remaining_verbs_models_is_named_with_a_suggestion(model, values, typo, suggestion):
    with pytest.raises(DraftsmithError, match=f"unknown config key {typo}") as err:
        from_mapping(model, {**values, typo: 1})
    assert f"did you mean {suggestion}?" in err.value.fix


@pytest.mark.parametrize("model,values,what", [
    (ConvertSettings, {"src": "a", "out": "b", "to": "vllm", "dtype": "fp8"}, "unknown --dtype"),
    (ConvertSettings, {"src": "a", "out": "b", "to": "vllm", "aux_convention": "shifted"}, "unknown --aux-convention"),
    (ConvertSettings, {"src": "a", "out": "b", "to": "vllm", "k": "three"}, "bad value for k"),
    (CaptureSettings, {"max_length": "long"}, "bad value for max_length"),
    (ExportStoreSettings, {"store": "a", "out": "b", "format": "arrow"}, "unknown --format"),
])
def test_an_invalid_value_of_the_remaining_verbs_models_is_refused(model, values, what):
    with pytest.raises(DraftsmithError, match=what):
        from_mapping(model, values)


def test_a_verbs_required_path_is_refused_by_its_model_when_missing():
    with pytest.raises(DraftsmithError, match="bad value for logfile|logfile"):
        from_mapping(DiagnoseSettings, {"as_json": True})
