"""A resume continues only what matches: `train` and `regenerate` into an output made with other settings are
refused before any work (each differing setting old -> new, --out elsewhere or --overwrite the fix), and nothing
there changes; the same settings resume; --overwrite starts over and deletes only what the verb wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from badinput import refused, snapshot
from conftest import write_conversations
from draftsmith.cli import main
from test_train import store  # noqa: F401 (the tiny store fixture)


def train_argv(store: Path, out: Path, **kw) -> list[str]:
    args = {"store": store, "out": out, "lr": "3e-3", "batch-tokens": "256", "draft-vocab-size": "64", "ttt-steps": "2",
            "eval-fraction": "0", "max-steps": "2", "save-every": "1", "log-every": "1", "quiet": None, **kw}
    argv = ["train"]
    for k, v in args.items():
        argv += [f"--{k}"] + ([str(v)] if v is not None else [])
    return argv


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in (r := json.loads(line)) and "eval" not in r]


@pytest.fixture(scope="module")
def trained(store, tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints at steps 1 and 2), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_argv(store, out)) == 0
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.parametrize("changed, named", [
    ({"lr": "1e-2"}, "lr 0.003 -> 0.01"),
    ({"seed": "1"}, "seed 0 -> 1"),
    ({"ttt-steps": "3"}, "ttt_steps 2 -> 3"),
    ({"lr": "1e-2", "seed": "1", "ttt-steps": "3"}, "ttt_steps 2 -> 3"),
])
def test_a_rerun_with_other_settings_is_refused_and_changes_nothing(store, trained, tmp_path, capsys, changed, named):
    out = copy_of(trained, tmp_path)
    before = snapshot(tmp_path)
    err = refused(capsys, train_argv(store, out, **changed), tmp_path, before, named, "--overwrite", "another --out",
                  "other settings")
    for flag in changed:  # the fix gives the recorded values back, as flags
        assert f"--{flag} " in err.split("fix:")[1], err
    assert json.loads((out / "train_config.json").read_text())["seed"] == 0


def test_a_rerun_with_the_same_settings_resumes_and_a_longer_max_steps_extends_the_run(store, trained, tmp_path,
                                                                                       capsys):
    out = copy_of(trained, tmp_path)
    capsys.readouterr()
    assert main(train_argv(store, out, **{"max-steps": "4", "eval-every": "3"})) == 0
    assert "resumed at step 2" in capsys.readouterr().out
    assert steps_logged(out) == [1, 2, 3, 4], "steps 1-2 kept, 3-4 trained on"
    record = json.loads((out / "train_config.json").read_text())
    assert (record["max_steps"], record["eval_every"], record["peak_lr"], record["world"]) == (4, 3, 3e-3, 1)


def test_overwrite_starts_over_and_deletes_only_what_train_wrote(store, trained, tmp_path, capsys):
    out = copy_of(trained, tmp_path)
    (out / "notes.txt").write_text("mine\n")
    (out / "mine").mkdir()
    capsys.readouterr()
    assert main(train_argv(store, out, lr="1e-2", seed="1", overwrite=None)) == 0
    assert "resumed" not in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "mine").is_dir()
    record = json.loads((out / "train_config.json").read_text())
    assert (record["peak_lr"], record["seed"]) == (1e-2, 1) and steps_logged(out) == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000001", "step-000002"]


def test_a_folder_of_the_users_is_refused(store, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    refused(capsys, train_argv(store, out), tmp_path, before, "holds files draftsmith did not write", "notes.txt",
            "--overwrite")


def test_checkpoints_without_their_record_are_refused(store, trained, tmp_path, capsys):
    out = copy_of(trained, tmp_path)
    (out / "train_config.json").unlink()
    before = snapshot(tmp_path)
    refused(capsys, train_argv(store, out), tmp_path, before, "without a readable record", "--overwrite")


def test_the_trainer_itself_refuses_to_record_settings_its_weights_were_not_trained_with(store, trained, tmp_path):
    """The Python entry point (run's train stage calls it) checks too, before it writes anything."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.settings import TrainConfig
    from draftsmith.train.trainer import Trainer

    out = copy_of(trained, tmp_path)
    before = snapshot(tmp_path)
    cfg = TrainConfig(out=str(out), store=str(store), lr=1e-2, batch_tokens=256, draft_vocab_size=64, ttt_steps=2,
                      eval_fraction=0.0, max_steps=2)
    with Trainer(cfg) as trainer, pytest.raises(DraftsmithError, match="other settings") as err:
        trainer.run(progress=False)
    assert "lr 0.003 -> 0.01" in err.value.got
    assert snapshot(tmp_path) == before


# -- regenerate -----------------------------------------------------------------------------------------------

@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"print hello world {i}"}) + "\n" for i in range(3)))
    return path


def regenerate_argv(target: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["regenerate", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "3", *extra]


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_regenerate_appends_only_with_the_same_settings(tiny_target, prompts, tmp_path, capsys):
    out = tmp_path / "conv.jsonl"
    assert main(regenerate_argv(tiny_target, prompts, out, "--limit", "2")) == 0
    assert ids(out) == ["p0", "p1"]
    before = snapshot(tmp_path)
    for extra, named in ((["--temperature", "0.7"], "temperature 0.0 -> 0.7"),
                         (["--max-new-tokens", "5"], "max_new_tokens 3 -> 5"),
                         (["--seed", "1", "--dtype", "bfloat16"], 'dtype "float32" -> "bfloat16"')):
        refused(capsys, regenerate_argv(tiny_target, prompts, out, *extra), tmp_path, before, named,
                "--overwrite", "another --out")
    # the same settings with a larger --limit (and another batch size) continue the file
    assert main(regenerate_argv(tiny_target, prompts, out, "--batch-size", "2")) == 0
    assert ids(out) == ["p0", "p1", "p2"]
    # --overwrite starts the file over with the new settings
    assert main(regenerate_argv(tiny_target, prompts, out, "--temperature", "0.7", "--limit", "1", "--overwrite")) == 0
    assert ids(out) == ["p0"]
    assert json.loads((tmp_path / "conv.jsonl.settings.json").read_text())["temperature"] == 0.7


def test_regenerate_refuses_to_append_to_a_file_it_has_no_record_of(tiny_target, prompts, tmp_path, capsys):
    out = write_conversations(tmp_path / "mine.jsonl", n=2)
    before = snapshot(tmp_path)
    refused(capsys, regenerate_argv(tiny_target, prompts, out), tmp_path, before, "no record of", "--overwrite")
