"""The one config system: run's sections are the verbs' models, unknown keys get a suggestion, docs stay generated."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from draftsmith.config import add_flags, from_flags, from_mapping
from draftsmith.errors import DraftsmithError
from draftsmith.eval import EvalSettings
from draftsmith.runconfig import RUN_TRAIN_DEFAULTS, RunConfig
from draftsmith.train import TrainConfig, TrainSettings

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
