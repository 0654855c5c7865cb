"""Nothing a user owns is deleted or overwritten (issue 60, deliver 1), with real files.

export, convert and export-store refuse an output folder that holds files draftsmith did not write, or that
overlaps their source, before they read anything (exit 2, the folder unchanged; `--overwrite` the fix); they
write into a temporary sibling and swap it in, so a failure leaves the old folder whole. `run --out` refuses
a folder that was never a run directory and wipes only stage outputs it wrote. Engine capture deletes only
the connector files of its own requests, and finds vLLM before it touches anything.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from badinput import refused, snapshot
from conftest import write_conversations
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import MARKER, written_by

EXPORT_FILES = {"model.safetensors", "config.json", "README.md"}


def user_folder(path: Path, *names: str) -> Path:
    """A folder of the user's: a notes file and the named entries (`x/` a folder holding a file)."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("my notes\n")
    for name in names:
        if name.endswith("/"):
            (path / name).mkdir()
            (path / name / "mine.txt").write_text("mine\n")
        else:
            (path / name).write_text("mine\n")
    return path


# ---------------------------------------------------------------- export


def test_export_refuses_a_folder_of_the_users_and_overwrite_replaces_it(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    out = user_folder(tmp_path / "out")
    before = snapshot(tmp_path)
    err = refused(capsys, ["export", str(ckpt), str(out)], tmp_path, before, "holds files draftsmith did not write",
                  "notes.txt", "--overwrite")
    assert "OUT" in err
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {MARKER} and written_by(out) == "export"


def test_export_writes_todays_files_plus_only_the_marker(checkpoint, tmp_path):
    from draftsmith.export.formats import export

    _, ckpt = checkpoint
    out = export(ckpt, tmp_path / "vllm", "vllm", dtype="float32")
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {MARKER}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary sibling is left"


def test_a_re_export_over_its_own_folder_replaces_it(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    out = tmp_path / "out"
    assert main(["export", str(ckpt), str(out), "--dtype", "float32"]) == 0
    assert main(["export", str(ckpt), str(out), "--dtype", "bfloat16"]) == 0  # its own folder, as it left it
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {MARKER}
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    # a file put into that folder since is the user's: refused (a blind probe lost its notes here), --overwrite
    # replaces the folder
    (out / "stale.bin").write_text("put here after the export")
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(ckpt), str(out)], tmp_path, before, "stale.bin")
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {MARKER}


def test_a_failure_in_the_middle_of_an_export_leaves_the_old_folder_whole(checkpoint, tmp_path, monkeypatch):
    import draftsmith.export.formats as formats

    _, ckpt = checkpoint
    out = formats.export(ckpt, tmp_path / "out", "vllm", dtype="float32")
    before = snapshot(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(formats, "save_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        formats.export(ckpt, out, "vllm", dtype="bfloat16")
    assert snapshot(tmp_path) == before, "the old export and nothing else: no half-written or temporary folder"


def test_exporting_a_checkpoint_onto_itself_is_refused(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(ckpt), str(ckpt)], tmp_path, before, "overlaps the source")
    refused(capsys, ["export", str(ckpt), str(ckpt), "--overwrite"], tmp_path, before, "overlaps the source")
    refused(capsys, ["export", str(ckpt), str(ckpt / "vllm")], tmp_path, before, "overlaps the source")
    refused(capsys, ["export", str(ckpt), str(tmp_path)], tmp_path, before, "overlaps the source")
    assert load_file(str(ckpt / "model.safetensors"))["fc.weight"].dtype == torch.float32


def test_export_into_a_non_empty_working_directory_is_refused(checkpoint, tmp_path, monkeypatch, capsys):
    _, ckpt = checkpoint
    work = user_folder(tmp_path / "work")
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(ckpt), "."], tmp_path, before, "holds files draftsmith did not write", "notes.txt")


def test_several_formats_are_all_checked_before_the_first_is_written(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    out = tmp_path / "out"
    user_folder(out / "sglang")
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(ckpt), str(out), "--format", "vllm,sglang"], tmp_path, before, "sglang")


def test_export_refuses_before_it_reads_the_checkpoint(tmp_path, capsys):
    src = tmp_path / "not-a-checkpoint"
    src.mkdir()  # no config.json: reading it would fail with a traceback, not a refusal
    out = user_folder(tmp_path / "out")
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(src), str(out)], tmp_path, before, "holds files draftsmith did not write")


# ---------------------------------------------------------------- convert


def test_convert_refuses_a_folder_of_the_users_and_its_own_source(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    out = user_folder(tmp_path / "out")
    before = snapshot(tmp_path)
    refused(capsys, ["convert", str(ckpt), str(out), "--to", "draftsmith"], tmp_path, before,
            "holds files draftsmith did not write", "--overwrite")
    refused(capsys, ["convert", str(ckpt), str(ckpt), "--to", "vllm"], tmp_path, before, "overlaps the source")
    assert main(["convert", str(ckpt), str(out), "--to", "vllm", "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} == EXPORT_FILES | {MARKER} and written_by(out) == "convert"


def test_a_re_convert_over_its_own_folder_replaces_it_and_a_failure_keeps_it(checkpoint, tmp_path, monkeypatch):
    import draftsmith.export.convert as convert_mod

    _, ckpt = checkpoint
    out = tmp_path / "out"
    assert main(["convert", str(ckpt), str(out), "--to", "draftsmith"]) == 0
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", MARKER}
    assert main(["convert", str(ckpt), str(out), "--to", "draftsmith", "--dtype", "bfloat16"]) == 0
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    before = snapshot(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_mod, "save_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_mod.convert(ckpt, out, "draftsmith")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- export-store


@pytest.fixture(scope="module")
def store(tiny_target, tmp_path_factory) -> Path:
    from draftsmith.capture.local import capture

    root = tmp_path_factory.mktemp("ownership_store")
    capture(write_conversations(root / "conv.jsonl", n=4), root / "store", target=str(tiny_target), shard_tokens=300)
    return root / "store"


def test_export_store_refuses_a_folder_of_the_users_and_the_store_itself(store, tmp_path, capsys):
    out = user_folder(tmp_path / "out")
    before = snapshot(tmp_path)
    refused(capsys, ["export-store", str(store), str(out)], tmp_path, before, "holds files draftsmith did not write",
            "--overwrite")
    store_before = snapshot(store)
    refused(capsys, ["export-store", str(store), str(store)], store, store_before, "overlaps the source")
    refused(capsys, ["export-store", str(store), str(store / "spec")], store, store_before, "overlaps the source")
    refused(capsys, ["export-store", str(store), str(out), "--index-only"], tmp_path, before, "--index-only")


def test_export_store_replaces_its_own_export_and_overwrite_a_users_folder(store, tmp_path):
    from draftsmith.capture.interop import EXPORT_INFO, HS_DIR, TOKEN_FREQ, export_speculators

    out = tmp_path / "out"
    export_speculators(store, out, index=False)
    first = snapshot(out)
    (out / HS_DIR / "hs_99.safetensors").write_text("a leftover")  # inside the export draftsmith wrote
    export_speculators(store, out, index=False)
    assert snapshot(out) == first and written_by(out) == "export-store"
    assert {EXPORT_INFO, TOKEN_FREQ, HS_DIR, MARKER} <= {p.name for p in out.iterdir()}
    mine = user_folder(tmp_path / "mine")
    with pytest.raises(DraftsmithError, match="holds files draftsmith did not write"):
        export_speculators(store, mine, index=False)
    export_speculators(store, mine, index=False, overwrite=True)
    assert not (mine / "notes.txt").exists() and (mine / EXPORT_INFO).is_file()


# ---------------------------------------------------------------- run


@pytest.fixture
def stub_stages(monkeypatch):
    """`run` with every stage replaced by one that writes its first output (the ordering, the state file and the
    ownership checks are the real ones); returns the stages that ran, in order."""
    import draftsmith.run.pipeline as pipeline
    import draftsmith.run.report as report
    from draftsmith.run.state import stage_outputs

    ran: list[str] = []

    def stub(stage):
        def run_stage(ctx):
            ran.append(stage)
            first = stage_outputs(ctx.out, stage, ctx.cfg)[0]
            if first.suffix:
                first.write_text(f"{stage} output\n")
            else:
                first.mkdir(exist_ok=True)
                (first / "out.txt").write_text(f"{stage} output\n")
        return run_stage

    def summary_only(out: Path, summary: dict) -> None:  # the report needs real stage outputs
        (out / "report.json").write_text("{}\n")
        summary.update(report=str(out / "report.md"), drafter=str(out / "export-vllm"))

    monkeypatch.setattr(pipeline, "RUNNERS", {stage: stub(stage) for stage in pipeline.STAGES})
    monkeypatch.setattr(pipeline, "write_summary", summary_only)
    monkeypatch.setattr(report, "headline", lambda doc: "run: (stub stages)")
    return ran


RUN_ARGS = ["engine_python=/nonexistent/python", "bench.llamacpp_k=[]"]


def run_args(out: Path, *extra: str) -> list[str]:
    return ["run", "--out", str(out), *RUN_ARGS, *extra]


def test_run_refuses_a_folder_that_was_never_a_run_directory(stub_stages, tmp_path, capsys):
    out = user_folder(tmp_path / "mine", "train/", "bench/", "store/", "conversations.jsonl")
    before = snapshot(tmp_path)
    refused(capsys, run_args(out), tmp_path, before, "holds files draftsmith did not write", "--overwrite")
    assert stub_stages == [], "no stage ran"


def test_run_marks_its_folder_and_a_changed_stage_wipes_only_what_the_run_wrote(stub_stages, tmp_path):
    out = tmp_path / "run"
    assert main(run_args(out)) == 0
    assert written_by(out) == "run" and stub_stages == ["regenerate", "capture", "train", "export", "eval", "check"]
    (out / "notes.txt").write_text("my notes\n")
    (out / "train" / "my-plot.png").write_text("mine, inside a stage folder the run wrote")
    stub_stages.clear()
    assert main(run_args(out, "train.lr=0.001")) == 0
    assert stub_stages == ["train", "export", "eval", "check"]
    assert (out / "notes.txt").read_text() == "my notes\n", "a file outside the stage outputs stays"
    assert not (out / "train" / "my-plot.png").exists(), "train's folder was the run's: replaced as a whole"
    assert (out / "conversations.jsonl").read_text() == "regenerate output\n"


def test_run_refuses_a_stage_output_it_never_wrote_in_its_own_folder(stub_stages, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(run_args(out, "skip=eval")) == 0
    (out / "eval.json").write_text('{"mine": true}\n')  # the eval stage never ran here: the user's
    stub_stages.clear()
    before = snapshot(tmp_path)
    refused(capsys, run_args(out), tmp_path, before, "stage outputs this run did not write", "eval.json",
            "--overwrite")
    assert stub_stages == []


def test_run_overwrite_replaces_the_runs_own_outputs_and_keeps_the_rest(stub_stages, tmp_path):
    from draftsmith.run.state import STATE_FILE

    out = user_folder(tmp_path / "mine", "train/", "conversations.jsonl", "keep.csv")
    assert main(run_args(out, "--overwrite")) == 0
    assert written_by(out) == "run" and (out / STATE_FILE).is_file()
    assert (out / "notes.txt").read_text() == "my notes\n" and (out / "keep.csv").read_text() == "mine\n"
    assert (out / "conversations.jsonl").read_text() == "regenerate output\n"
    assert not (out / "train" / "mine.txt").exists() and (out / "train" / "out.txt").is_file()


def test_a_stage_start_wipes_outputs_only_when_the_run_started_that_stage(tmp_path):
    from draftsmith.run.state import RunState

    out = user_folder(tmp_path / "run", "train/")
    state = RunState.load(out)
    assert state.start("train", "h1", [out / "train"]) is False
    assert (out / "train" / "mine.txt").is_file(), "a stage the run never started wipes nothing"
    assert state.start("train", "h1", [out / "train"]) is True
    assert state.start("train", "h2", [out / "train"]) is False
    assert not (out / "train").exists(), "started before with other settings: its outputs are the run's"


# ---------------------------------------------------------------- engine capture's --hs-dir


def connector_files(folder: Path, stem: str) -> list[Path]:
    paths = [folder / f"{stem}{suffix}" for suffix in (".safetensors", ".safetensors.lock", ".safetensors.tmp",
                                                        ".safetensors.error")]
    for p in paths:
        p.write_text("states")
    return paths


def test_only_this_runs_connector_files_are_deleted(tmp_path):
    from draftsmith.capture.vllm import RequestIds, discard_run_files, run_files

    hs = user_folder(tmp_path / "hs", "model.safetensors", "weights.lock", "cache.tmp")
    ids, other = RequestIds(), RequestIds()
    sent = [ids.next() for _ in range(3)]
    assert len(set(sent)) == 3 and all(ids.token in i for i in sent) and ids.token != other.token
    ours = connector_files(hs, f"cmpl-{sent[0]}-0") + connector_files(hs, f"cmpl-{sent[2]}-0")
    theirs = connector_files(hs, f"cmpl-{other.next()}-0")  # another capture sharing /dev/shm
    (hs / f"{ids.token}.txt").write_text("not a connector file")
    before = snapshot(hs)
    assert run_files(hs, ids) == sorted(ours)
    assert discard_run_files(hs, ids) == sorted(ours)
    after = snapshot(hs)
    assert set(before) - set(after) == {p.name for p in ours} and all(p.exists() for p in theirs)
    assert discard_run_files(tmp_path / "absent", ids) == []


class ConnectorServer:
    """A capture server whose reply names `path` as the request's states, whatever the request id."""

    def __init__(self, path: str):
        import http.server

        reply = json.dumps({"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3]}],
                            "kv_transfer_params": {"hidden_states_path": path}}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_states_file_not_named_for_the_request_is_refused_and_left_alone(tmp_path):
    from draftsmith.capture.vllm import RequestIds, request_states

    theirs = tmp_path / "hs" / "their-model.safetensors"
    theirs.parent.mkdir()
    theirs.write_text("someone else's")
    server = ConnectorServer(str(theirs))
    try:
        with pytest.raises(DraftsmithError, match="not named for draftsmith's request") as err:
            request_states(server.url, [1, 2], RequestIds())
    finally:
        server.close()
    assert "--print-server-args" in err.value.fix and theirs.read_text() == "someone else's"


def test_engine_capture_finds_vllm_before_it_touches_the_hs_dir(tmp_path, monkeypatch, capsys):
    from draftsmith.engines.process import ENGINE_ENV_VARS

    monkeypatch.setenv(ENGINE_ENV_VARS["vllm"], str(tmp_path / "no-vllm" / "python"))
    hs = user_folder(tmp_path / "hs", "a.safetensors", "a.safetensors.lock", "b.tmp")
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    before = snapshot(tmp_path)
    refused(capsys, ["capture", "--engine", "vllm", "--conversations", str(conv), "--out", str(tmp_path / "store"),
                     "--hs-dir", str(hs)], tmp_path, before, "no vllm interpreter")
