"""Cases a blind bad-input probe found BAD or WEAK, each now a named error before any work (or the right result).

Every refusal goes through `badinput.refused`: exit 2, what/got/expected/fix, the folder unchanged.
"""

from __future__ import annotations

import json
import os

import pytest
from pathlib import Path

from badinput import refused, snapshot
from conftest import write_conversations
from draftsmith.cli import main


def test_eval_json_onto_a_users_file_is_refused_before_the_target_loads(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--drafter", str(drafter), "--json", str(notes)], tmp_path, before,
            "is a file draftsmith did not write", "--overwrite")


def test_eval_outputs_of_the_wrong_kind_and_an_impossible_tree_are_refused(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    (tmp_path / "afolder").mkdir()
    (tmp_path / "afile").write_text("x\n")
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--drafter", str(drafter), "--json", str(tmp_path / "afolder")], tmp_path, before,
            "names a folder")
    refused(capsys, ["eval", "--drafter", str(drafter), "--out", str(tmp_path / "afile")], tmp_path, before,
            "names a file")
    refused(capsys, ["eval", "--drafter", str(drafter), "--topk", "100000", "--draft-tokens", "3"], tmp_path, before,
            "larger than the drafter's draft vocabulary")


def test_an_eval_results_file_is_recognised_by_its_keys(tmp_path):
    from draftsmith.eval.evaluation import is_eval_json

    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps({"k": 4, "recommended_k": 4, "sweep": [], "settings": {}}))
    theirs.write_text(json.dumps({"k": 4, "tau": 2.0}))
    assert is_eval_json(ours) and not is_eval_json(theirs) and not is_eval_json(tmp_path / "missing.json")


def test_capture_refuses_an_empty_conversations_file_and_writes_nothing(tiny_target, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    before = snapshot(tmp_path)
    refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(tmp_path / "empty.jsonl"),
                     "--out", str(tmp_path / "store")], tmp_path, before, "holds no conversation")


def test_capture_refuses_a_negative_shard_size_a_users_folder_and_a_file(tiny_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    (tmp_path / "afile").write_text("x\n")
    before = snapshot(tmp_path)
    base = ["capture", "--target", str(tiny_target), "--conversations", str(conv)]
    refused(capsys, [*base, "--out", str(tmp_path / "store"), "--shard-tokens", "-5"], tmp_path, before,
            "--shard-tokens out of range")
    refused(capsys, [*base, "--out", str(mine)], tmp_path, before, "holds files draftsmith did not write")
    refused(capsys, [*base, "--out", str(tmp_path / "afile")], tmp_path, before, "names a file")


def test_a_capture_resume_with_other_settings_names_what_changed(tiny_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    base = ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out", str(tmp_path / "store")]
    assert main([*base, "--max-length", "64"]) == 0
    before = snapshot(tmp_path)
    err = refused(capsys, [*base, "--max-length", "48"], tmp_path, before, "made with other settings")
    assert "max_length 64 -> 48" in err


@pytest.mark.parametrize("value, words", [("inf", ("bad value for lr", "a finite number")),
                                          ("nan", ("bad value for lr", "a finite number")),
                                          ("-inf", ("bad value for lr", "a finite number"))])
def test_a_learning_rate_that_is_not_finite_is_refused(tmp_path, capsys, value, words):
    (tmp_path / "store").mkdir()
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "t"), f"--lr={value}"],
            tmp_path, before, *words)


def test_a_prompt_with_an_empty_user_turn_is_refused(tiny_target, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    before = snapshot(tmp_path)
    refused(capsys, ["regenerate", "--target", str(tiny_target), "--prompts", str(prompts),
                     "--out", str(tmp_path / "conv.jsonl")], tmp_path, before, "empty user turn", ":2")


def test_a_regenerate_that_reaches_no_endpoint_leaves_no_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n")
    before = snapshot(tmp_path)
    refused(capsys, ["regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "conv.jsonl"),
                     "--endpoint", "http://127.0.0.1:9/v1", "--max-retries", "0", "--request-timeout", "3"],
            tmp_path, before)


def test_trains_record_holds_absolute_paths_so_a_resume_from_another_folder_matches(tmp_path, monkeypatch):
    from draftsmith.train.resume import record, shaping
    from draftsmith.train.settings import TrainConfig

    (tmp_path / "store").mkdir()
    monkeypatch.chdir(tmp_path)
    written = record(TrainConfig(store="store", out="t"), world=1)
    assert written["store"] == str(tmp_path / "store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert shaping(written) == shaping(record(TrainConfig(store=str(tmp_path / "store"), out="t"), world=1))
    assert os.path.isabs(written["store"])


def test_a_draft_vocabulary_larger_than_the_targets_is_refused():
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.drafter import check_draft_vocab_size

    check_draft_vocab_size(None, 49152)
    check_draft_vocab_size(49152, 49152)
    with pytest.raises(DraftsmithError, match="larger than the target's vocabulary"):
        check_draft_vocab_size(10_000_000, 49152)



def test_run_takes_overrides_after_an_option(tmp_path, monkeypatch):
    """`run CONFIG --out DIR key=value` (the probe got the top-level usage error): the override is applied."""
    from draftsmith.run import pipeline

    class Resolved(Exception):
        pass

    def resolved(cfg, overwrite=False):
        raise Resolved(cfg)

    monkeypatch.setattr(pipeline, "run_pipeline", resolved)
    config = tmp_path / "cfg.yaml"
    config.write_text("eval:\n  limit: 5\n")
    with pytest.raises(Resolved) as got:
        main(["run", str(config), "--out", str(tmp_path / "r"), "train.lr=3e-4", "eval.max_new_tokens=16"])
    cfg = got.value.args[0]
    assert (cfg.train.lr, cfg.eval.limit, cfg.eval.max_new_tokens, Path(cfg.out)) == (3e-4, 5, 16, tmp_path / "r")


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-such-flag"])
    assert exc.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_a_drafter_whose_config_contradicts_its_block_is_refused_by_export_and_eval(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    config = json.loads((drafter / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] * 2  # what the engines would read; block and weights say otherwise
    (drafter / "config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    for argv in (["export", str(drafter), str(tmp_path / "out"), "--format", "vllm"],
                 ["eval", "--drafter", str(drafter)]):
        err = refused(capsys, argv, tmp_path, before, "contradicts itself", "hidden_size")
        assert f"hidden_size {config['hidden_size']}" in err
