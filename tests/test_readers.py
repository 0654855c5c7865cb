"""Every file a verb reads, malformed: exit 2 with a named error (the file, the line, what was expected, the fix)
and nothing written or deleted; and the feature store's own cases: shard names kept inside the store, a corrupt
shard that the rerun capture writes again, a resume that keeps the target head, and files readable as the umask says.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from badinput import refused, snapshot
from conftest import write_conversations
from test_store import captured  # noqa: F401  (a store of 30 conversations in shards of 400 tokens, shared)
from draftsmith.capture.local import capture
from draftsmith.capture.store import FeatureStore
from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json, read_jsonl, read_yaml

CLI = [sys.executable, "-m", "draftsmith.cli"]
GOOD = {"id": "g", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def jsonl(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


# ---------------------------------------------------------------- the readers themselves

def test_a_cut_json_file_is_named_with_its_line_and_column(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{\n  "version": 2,\n  "shards": [{"fi')
    with pytest.raises(DraftsmithError) as e:
        read_json(path, "feature-store manifest")
    assert str(path) in e.value.what and "line 3, column" in e.value.what and e.value.expected and e.value.fix


@pytest.mark.parametrize("text", ["", "{\n", '{"a": 1,\n\n'])
def test_an_empty_or_cut_json_file_is_named_too(text, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(DraftsmithError, match="is not valid JSON at line"):
        read_json(path, "drafter config")


def test_invalid_utf8_is_named_by_line_and_column(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", json.dumps(GOOD), b'{"id": "x", "messages": "caf\xe9"}')
    with pytest.raises(DraftsmithError) as e:
        list(read_jsonl(path, "conversations file"))
    assert "line 2, column 29" in e.value.what and e.value.expected == "UTF-8 text" and "0xe9" in e.value.got


def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", json.dumps(GOOD), "", "[1, 2]")
    with pytest.raises(DraftsmithError, match="line 3 is not a JSON object"):
        list(read_jsonl(path, "conversations file"))


def test_yaml_errors_name_the_line_and_a_list_is_not_a_mapping(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  lr: [1, 2\nout: x\n")
    with pytest.raises(DraftsmithError, match=r"not valid YAML at line \d+, column \d+"):
        read_yaml(path, "run config")
    path.write_text("- train\n- out\n")
    with pytest.raises(DraftsmithError, match="not a YAML mapping"):
        read_yaml(path, "run config")
    path.write_text("")
    assert read_yaml(path, "run config") == {}


# ---------------------------------------------------------------- regenerate: prompt files

BAD_PROMPTS = {
    "invalid UTF-8": ((json.dumps({"prompt": "ok"}).encode(), b'{"prompt": "na\xefve"}'), ("line 2", "UTF-8")),
    "messages without content": ((json.dumps({"prompt": "ok"}), json.dumps({"messages": [{"role": "user"}]})),
                                 ("p.jsonl:2", "'content'")),
    "ShareGPT without value": ((json.dumps({"conversations": [{"from": "human"}]}),), ("p.jsonl:1", "'value'")),
    "no prompt at all": ((json.dumps({"id": "x", "text": "hi"}),), ("p.jsonl:1", "no user turn")),
    "empty turns": ((json.dumps({"turns": []}),), ("p.jsonl:1", "turns")),
    "not JSON": ((json.dumps({"prompt": "ok"}), '{"prompt": "cut'), ("line 2", "not valid JSON")),
    "not an object": (('"just a string"',), ("line 1", "not a JSON object")),
}


# ---------------------------------------------------------------- capture: conversations

BAD_CONVERSATIONS = {
    "invalid UTF-8": ((json.dumps(GOOD).encode(), json.dumps(GOOD).encode(), b'{"id": "b\xff"}'), ("line 3", "UTF-8")),
    "empty messages": ((json.dumps(GOOD), json.dumps({"id": "e", "messages": []})), ("c.jsonl:2", "without messages")),
    "a message without a role": ((json.dumps({"id": "r", "messages": [{"content": "hi"}]}),), ("c.jsonl:1", "role")),
    "a message without content": ((json.dumps({"id": "c", "messages": [{"role": "user"}]}),),
                                  ("c.jsonl:1", "content")),
    "not JSON": ((json.dumps(GOOD), "{'id': 'single quotes'}"), ("line 2", "not valid JSON")),
}


READ_BY = {  # verb -> (its bad files, the file's name, its command line)
    "regenerate": (BAD_PROMPTS, "p.jsonl", lambda target, f, tmp: ["regenerate", "--target", target, "--prompts", f,
                                                                  "--out", str(tmp / "conv.jsonl")]),
    "capture": (BAD_CONVERSATIONS, "c.jsonl", lambda target, f, tmp: ["capture", "--target", target,
                                                                     "--conversations", f, "--out", str(tmp / "store")]),
}


@pytest.mark.parametrize("verb, case", [(v, c) for v, (cases, _, _) in READ_BY.items() for c in sorted(cases)])
def test_a_malformed_jsonl_file_is_refused_by_the_verb_that_reads_it(verb, case, tiny_target, tmp_path, capsys):
    """regenerate's prompt file, capture's conversations: named with the file and line, and nothing written."""
    cases, name, argv = READ_BY[verb]
    lines, words = cases[case]
    path = jsonl(tmp_path / name, *lines)
    before = snapshot(tmp_path)
    refused(capsys, argv(str(tiny_target), str(path), tmp_path), tmp_path, before, str(path), *words)


# ---------------------------------------------------------------- run: the YAML config

BAD_CONFIGS = {
    "invalid UTF-8": (b"out: runs/x\ntrain:\n  lr: 3e-4 # \xe9\n", ("line 3", "UTF-8")),
    "YAML syntax": (b"train:\n  lr: [3e-4\nout: x\n", ("not valid YAML at line",)),
    "a list": (b"- train\n- capture\n", ("not a YAML mapping",)),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_run_refuses_a_malformed_config_before_any_stage(case, tmp_path, capsys):
    text, words = BAD_CONFIGS[case]
    config = tmp_path / "run.yaml"
    config.write_bytes(text)
    before = snapshot(tmp_path)
    refused(capsys, ["run", str(config), "--out", str(tmp_path / "run")], tmp_path, before, str(config), *words)


def test_run_refuses_a_missing_config(tmp_path, capsys):
    refused(capsys, ["run", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "run")], tmp_path, {},
            "run config not found", "nope.yaml")


# ---------------------------------------------------------------- eval, export, convert: one drafter reader

def cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def corrupt_weights(ckpt: Path) -> tuple[str, ...]:
    cut(ckpt / "model.safetensors")
    return "corrupt drafter weights", "model.safetensors"


def cut_config(ckpt: Path) -> tuple[str, ...]:
    cut(ckpt / "config.json")
    return "drafter config", "not valid JSON at line", "config.json"


def config_not_utf8(ckpt: Path) -> tuple[str, ...]:
    text = (ckpt / "config.json").read_bytes()
    (ckpt / "config.json").write_bytes(text.replace(b'"model_type"', b'"model_\xfftype"'))
    return "not UTF-8 text at line", "config.json"


def broken_drafter_block(ckpt: Path) -> tuple[str, ...]:
    config = json.loads((ckpt / "config.json").read_text())
    config["draftsmith"]["drafter"] = {"hidden_size": 32}
    (ckpt / "config.json").write_text(json.dumps(config))
    return "is not a drafter config", "config.json"


CORRUPT_DRAFTERS = {f.__name__: f for f in (corrupt_weights, cut_config, config_not_utf8, broken_drafter_block)}


DRAFTER_READERS = {  # verb -> its command line for a drafter folder
    "export": lambda target, ckpt, tmp: ["export", ckpt, str(tmp / "out"), "--format", "vllm"],
    "convert": lambda target, ckpt, tmp: ["convert", ckpt, str(tmp / "out"), "--to", "draftsmith"],
    "eval": lambda target, ckpt, tmp: ["eval", "--target", target, "--drafter", ckpt, "--limit", "1"],
}


@pytest.mark.parametrize("verb, case", [(v, c) for v in DRAFTER_READERS for c in sorted(CORRUPT_DRAFTERS)])
def test_a_corrupt_drafter_is_a_named_error_in_every_verb_that_reads_it(verb, case, checkpoint, tiny_target,
                                                                         tmp_path, capsys):
    """The one drafter reader (`checkpoint.read_drafter_config` / `read_drafter_weights`), as `check` names one."""
    _, ckpt = checkpoint
    words = CORRUPT_DRAFTERS[case](ckpt)
    before = snapshot(tmp_path)
    refused(capsys, DRAFTER_READERS[verb](str(tiny_target), str(ckpt), tmp_path), tmp_path, before, *words)


def test_a_cut_sharded_index_is_named(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"fc.weight": "model-0000')
    before = snapshot(tmp_path)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "out"), "--to", "draftsmith"], tmp_path, before,
            "drafter weights index", "not valid JSON")


# ---------------------------------------------------------------- the feature store

def store_copy(captured, tmp_path: Path) -> Path:
    root, _ = captured
    shutil.copytree(root / "store", tmp_path / "store")
    return tmp_path / "store"


def edit_manifest(store: Path, edit) -> None:
    manifest = json.loads((store / "manifest.json").read_text())
    edit(manifest)
    (store / "manifest.json").write_text(json.dumps(manifest, indent=2))


def train_argv(store: Path, tmp_path: Path) -> list[str]:
    return ["train", "--store", str(store), "--out", str(tmp_path / "train"), "--max-steps", "1"]


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/shard.safetensors", ".."])
def test_a_shard_name_outside_the_store_is_refused(name, captured, tmp_path, capsys):
    store = store_copy(captured, tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"the user's file")
    edit_manifest(store, lambda m: m["shards"][1].update(file=name))
    before = snapshot(tmp_path)
    refused(capsys, train_argv(store, tmp_path), tmp_path, before, "outside the store", "manifest.json")
    refused(capsys, ["capture", "--verify", "--out", str(store)], tmp_path, before, "outside the store")


def test_a_cut_manifest_is_named_with_its_line(captured, tmp_path, capsys):
    store = store_copy(captured, tmp_path)
    cut(store / "manifest.json", 0.6)
    before = snapshot(tmp_path)
    refused(capsys, train_argv(store, tmp_path), tmp_path, before, "feature-store manifest", "not valid JSON at line")


def test_a_corrupt_shard_is_refused_and_rerunning_the_capture_writes_it_again(captured, tiny_target, tmp_path, capsys):
    """The fix the error gives works: the same capture command checks every shard, writes the corrupt one and those
    after it again, and the store is then whole and equal to the one never corrupted."""
    root, conv = captured
    store = store_copy(captured, tmp_path)
    entry = json.loads((store / "manifest.json").read_text())["shards"][1]
    shard = store / entry["file"]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    err = refused(capsys, train_argv(store, tmp_path), tmp_path, before, "sha256 mismatch", entry["file"],
                  "rerun the `draftsmith capture` command")
    assert "recaptures from " + entry["file"] in err
    r = subprocess.run([*CLI, "capture", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                        str(store), "--shard-tokens", "400"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"{entry['file']} does not match its sha256" in r.stderr
    fixed, reference = FeatureStore(store), FeatureStore(root / "store")
    assert fixed.verify() == len(reference.manifest["shards"]) and fixed.complete
    assert [e["sha256"] for e in fixed.manifest["shards"]][:1] == [e["sha256"] for e in reference.manifest["shards"]][:1]
    assert len(fixed) == len(reference) and fixed.manifest["num_tokens"] == reference.manifest["num_tokens"]
    for k in range(len(reference)):
        assert torch.equal(fixed.sample(k).input_ids, reference.sample(k).input_ids)


def test_a_capture_stopped_by_a_full_disk_resumes_without_writing_the_target_head_again(captured, tiny_target,
                                                                                        tmp_path):
    """RLIMIT_FSIZE (EFBIG, as a full disk) lets the token counts and target head through and stops the first shard;
    the same command then finishes the store, and keeps the head file it published (same inode, never rewritten: a
    resume needs no room for a second copy of the head)."""
    _, conv = captured
    out = tmp_path / "store"
    args = ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out", str(out),
            "--shard-tokens", "400"]
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (150000, 150000)); from draftsmith.cli import main; "
            f"sys.exit(main({args!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "could not write shard-" in r.stderr, r.stderr
    head = out / "target_head.safetensors"
    published = os.stat(head)
    assert not json.loads((out / "manifest.json").read_text())["complete"]
    r = subprocess.run([*CLI, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    resumed = os.stat(head)
    assert (resumed.st_ino, resumed.st_mtime_ns) == (published.st_ino, published.st_mtime_ns), "head rewritten"
    store = FeatureStore(out)
    assert store.complete and store.verify() == len(store.manifest["shards"]) > 0
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_store_checkpoint_and_export_files_are_readable_as_the_umask_says(umask, mode, tiny_target, tmp_path):
    """safetensors writes 0600; every file the store, a checkpoint or an export writes has the umask's mode."""
    from draftsmith.export.formats import export
    from draftsmith.model.checkpoint import save_drafter
    from draftsmith.model.eagle3 import Eagle3Drafter

    from conftest import CFG

    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    old = os.umask(umask)
    try:
        capture(conv, tmp_path / "store", target=str(tiny_target), shard_tokens=200)
        ckpt = save_drafter(Eagle3Drafter(CFG), tmp_path / "ckpt")
        exported = export(ckpt, tmp_path / "vllm", "vllm")
    finally:
        os.umask(old)
    files = [p for folder in (tmp_path / "store", ckpt, exported) for p in folder.iterdir() if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != mode}
    assert not wrong, f"not {oct(mode)} under umask {oct(umask)}: {wrong}"


# ---------------------------------------------------------------- run: a report error after a failed stage

def test_a_report_error_after_a_failed_stage_is_a_note_and_without_one_it_is_raised(tmp_path, capsys):
    from draftsmith.run.pipeline import write_summary

    (tmp_path / "eval.json").write_text('{"cut')  # the report cannot read it
    write_summary(tmp_path, {"stages": {}, "failed": {"stage": "train", "error": "the stage's own error"}})
    assert "note: the report of this failed run could not be written" in capsys.readouterr().err
    with pytest.raises(json.JSONDecodeError):
        write_summary(tmp_path, {"stages": {}})
