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


@pytest.mark.parametrize("value, words", [("inf", ("bad value for --lr", "a finite number")),
                                          ("nan", ("bad value for --lr", "a finite number")),
                                          ("-inf", ("bad value for --lr", "a finite number"))])
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


# The second blind probe's cases (run on the code with the first probe's fixes).

def test_files_added_to_a_folder_export_wrote_are_not_wiped_by_the_next_export(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    out = tmp_path / "out"
    assert main(["export", str(drafter), str(out), "--format", "vllm"]) == 0
    assert main(["export", str(drafter), str(out), "--format", "vllm"]) == 0  # its own folder, unchanged: replaced
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    refused(capsys, ["export", str(drafter), str(out), "--format", "speculators"], tmp_path, before,
            "holds files draftsmith did not write", "notes.txt")


def test_files_added_to_a_folder_convert_wrote_are_not_wiped_by_the_next_convert(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    out = tmp_path / "cv"
    assert main(["convert", str(drafter), str(out), "--to", "vllm", "--target-layers", "30"]) == 0
    (out / "mine").mkdir()
    (out / "mine" / "x").write_text("mine\n")
    before = snapshot(tmp_path)
    refused(capsys, ["convert", str(drafter), str(out), "--to", "vllm", "--target-layers", "30"], tmp_path, before,
            "holds files draftsmith did not write", "mine")


def test_eval_and_bench_refuse_an_out_folder_with_the_users_files(checkpoint, tmp_path, capsys):
    _, drafter = checkpoint
    for name in ("evo", "bo"):
        (tmp_path / name).mkdir()
    (tmp_path / "evo" / "eval.md").write_text("my own eval notes\n")
    (tmp_path / "bo" / "bench.json").write_text("my bench\n")
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--drafter", str(drafter), "--out", str(tmp_path / "evo")], tmp_path, before,
            "holds files draftsmith did not write", "eval.md")
    refused(capsys, ["bench", "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "bo")], tmp_path,
            before, "holds files draftsmith did not write", "bench.json")


def tiny_store(tiny_target, root: Path) -> Path:
    assert main(["capture", "--target", str(tiny_target), "--conversations",
                 str(write_conversations(root / "conv.jsonl", n=4)), "--out", str(root / "store")]) == 0
    return root / "store"


@pytest.mark.parametrize("damage", ["num_samples three", "no shards", "lengths"])
def test_a_manifest_that_contradicts_itself_is_refused(tiny_target, tmp_path, capsys, damage):
    store = tiny_store(tiny_target, tmp_path)
    manifest = json.loads((store / "manifest.json").read_text())
    if damage == "num_samples three":
        manifest["num_samples"] = "three"
    elif damage == "no shards":
        manifest["shards"] = []
    else:
        manifest["shards"][0]["lengths"] = manifest["shards"][0]["lengths"][:-1]
    (store / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(tmp_path)
    refused(capsys, ["export-store", str(store), str(tmp_path / "es")], tmp_path, before, "is malformed")
    refused(capsys, ["capture", "--verify", "--out", str(store)], tmp_path, before, "is malformed")


def test_capture_refusing_a_users_folder_names_no_flag_it_lacks(tiny_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "conv.jsonl", n=4)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    err = refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(conv),
                           "--out", str(tmp_path / "mine")], tmp_path, before, "holds files draftsmith did not write")
    assert "--overwrite" not in err


def test_a_step_count_past_any_real_run_is_refused(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "t"),
                     "--max-steps", "99999999999999999999999"], tmp_path, before, "--max-steps out of range")


def test_a_format_list_is_checked_whole_before_the_first_format_is_written(tmp_path, capsys):
    """The shipped drafter is normed, which SGLang does not compute: nothing of vllm may be written first."""
    before = snapshot(tmp_path)
    refused(capsys, ["export", "smollm2", str(tmp_path / "out"), "--format", "vllm,sglang"], tmp_path, before,
            "sglang")


# The third blind probe's cases.

def test_a_learning_rate_past_one_is_refused(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "t"), "--lr", "1e30"],
            tmp_path, before, "--lr out of range")


def test_regenerate_refuses_to_write_over_its_own_prompts_even_with_overwrite(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n")
    before = snapshot(tmp_path)
    refused(capsys, ["regenerate", "--prompts", str(prompts), "--out", str(prompts), "--overwrite"], tmp_path, before,
            "--out is the --prompts file")


def test_train_refuses_its_store_as_its_out_even_with_overwrite(tiny_target, tmp_path, capsys):
    store = tiny_store(tiny_target, tmp_path)
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--store", str(store), "--out", str(store), "--overwrite"], tmp_path, before,
            "overlaps the source")


# The fourth blind probe's cases.

def target_must_not_load(monkeypatch, *modules):
    """Loading the target in any of `modules` fails the test: a refusal must come before it."""
    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was refused")

    for module in modules:
        monkeypatch.setattr(module, "load_target", loaded)


@pytest.mark.parametrize("damage, words", [
    ("prompts", ("line 2 is not valid JSON", "bad.jsonl")),
    ("cut weights", ("corrupt drafter weights", "model.safetensors")),
    ("garbled header", ("corrupt drafter weights",)),
    ("config", ("is not valid JSON",)),
    ("another target's drafter", ("was not made for the target", "vocab 96")),
])
def test_eval_refuses_bad_prompts_and_a_bad_drafter_before_the_target_loads(checkpoint, tiny_target, tmp_path, capsys,
                                                                            monkeypatch, damage, words):
    import draftsmith.target

    _, drafter = checkpoint
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\nnot json\n")
    weights = drafter / "model.safetensors"
    if damage == "cut weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbled header":
        weights.write_bytes(weights.read_bytes()[:8] + b"garbage!" + weights.read_bytes()[16:])
    elif damage == "config":
        (drafter / "config.json").write_text('{"architectures": [')
    target_must_not_load(monkeypatch, draftsmith.target)
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--target", str(tiny_target), "--drafter", str(drafter), "--limit", "2",
                     "--max-new-tokens", "8", *(["--prompts", str(prompts)] if damage == "prompts" else [])],
            tmp_path, before, *words)


def test_online_train_refuses_bad_conversations_before_the_target_loads(tiny_target, tmp_path, capsys, monkeypatch):
    import draftsmith.train.features

    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    conv.write_text(conv.read_text() + json.dumps({"id": "x", "messages": [{"role": "user"}]}) + "\n")
    target_must_not_load(monkeypatch, draftsmith.train.features)
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                     str(tmp_path / "t"), "--max-steps", "2"], tmp_path, before, "conv.jsonl:3")


@pytest.mark.parametrize("override, words", [
    ("eval.prompts={bad}", ("line 2 is not valid JSON",)),
    ("bench.prompts={missing}", ("unknown prompt source", "missing.jsonl")),
    ("train.draft_vocab_size=100000", ("larger than the target's vocabulary", "100000")),
])
def test_run_refuses_a_bad_prompt_set_or_draft_vocabulary_before_its_first_stage(tiny_target, tmp_path, capsys,
                                                                                 monkeypatch, override, words):
    from draftsmith.run import pipeline

    def ran(ctx):
        raise AssertionError("a stage ran before the bad input was refused")

    monkeypatch.setattr(pipeline, "RUNNERS", {stage: ran for stage in pipeline.RUNNERS})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a question"}) + "\nnot json\n")
    before = snapshot(tmp_path)
    refused(capsys, ["run", "--out", str(tmp_path / "r"), f"target={tiny_target}", "engine_python=/nonexistent/python",
                     override.format(bad=bad, missing=tmp_path / "missing.jsonl")], tmp_path, before, *words)


def test_a_run_that_built_no_drafter_names_none(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    config = tmp_path / "skip.yaml"
    config.write_text("skip: [regenerate, capture, train, export, eval, check, launch, bench]\n")
    assert main(["run", str(config), "--out", str(out), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "no drafter was built" in printed and "export-vllm" not in printed
    assert json.loads((out / "summary.json").read_text())["drafter"] is None


def test_the_run_summary_names_the_drafter_that_exists(checkpoint, tmp_path):
    from draftsmith.run.pipeline import built_drafter

    _, drafter = checkpoint
    out = tmp_path / "r"
    (out / "train").mkdir(parents=True)
    drafter.rename(out / "train" / "drafter")
    assert built_drafter(out) == str(out / "train" / "drafter")
    (out / "export-speculators").mkdir()
    (out / "export-speculators" / "config.json").write_text("{}")
    assert built_drafter(out) == str(out / "export-speculators")


@pytest.mark.parametrize("argv, words", [
    (["train", "--store", "S", "--out", "T", "--batch-tokens", "abc"], ("--batch-tokens", "'abc'", "an integer >= 1")),
    (["train", "--store", "S", "--out", "T", "--lr", "x"], ("--lr", "'x'", "a number > 0")),
    (["eval", "--drafter", "smollm2", "--depth", "1.5"], ("--depth", "'1.5'", "an integer")),
    (["capture", "--out", "S", "--shard-tokens", "1e3"], ("--shard-tokens", "'1e3'", "an integer")),
    (["eval", "--drafter", "smollm2", "--k", "1.5"], ("bad --k", "1.5")),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1", "--concurrency", "x"], ("bad value for --concurrency", "a comma list of int")),
])
def test_a_flag_of_the_wrong_type_is_a_named_error(tmp_path, capsys, argv, words):
    err = refused(capsys, argv, tmp_path, snapshot(tmp_path), *words)
    assert not err.startswith("usage:")


def test_trains_end_line_gives_tau_at_a_k_the_drafter_was_trained_for(tiny_target, tmp_path, capsys):
    store = tiny_store(tiny_target, tmp_path)
    capsys.readouterr()
    assert main(["train", "--store", str(store), "--out", str(tmp_path / "t"), "--max-steps", "2", "--ttt-steps", "2",
                 "--quiet"]) == 0
    end = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train: drafter")]
    assert len(end) == 1 and "simulated tau at k=2: " in end[0] and "nan" not in end[0]


def test_trains_end_line_says_tau_was_not_measured_without_held_back_samples():
    from draftsmith.train.command import held_back_line
    from draftsmith.train.trainer import EvalResult

    assert held_back_line(EvalResult(acc=[0.0, 0.0], tau={}, loss=0.0)) == \
        "no held-back samples: simulated tau not measured"
    assert held_back_line(EvalResult(acc=[0.5] * 7, tau={k: 1 + k / 10 for k in range(1, 8)}, loss=1.0)) \
        .startswith("simulated tau at k=4: 1.40")


@pytest.mark.parametrize("record, words", [('{"regenerate":', ("is not valid JSON",)),
                                           ('{"regenerate": 3}', ("is malformed", "stage regenerate: 3"))])
def test_a_damaged_stage_record_is_named_not_a_traceback(tmp_path, capsys, record, words):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "stages.json").write_text(record)
    before = snapshot(tmp_path)
    refused(capsys, ["run", "--out", str(tmp_path / "r"), "skip=regenerate,capture,train,export,eval,check,launch,bench"],
            tmp_path, before, "stages.json", *words)


@pytest.mark.parametrize("device, words", [("tpu", ("unknown device", "'tpu'")), ("cuda:99", ("no CUDA device cuda:99",))])
def test_a_device_this_machine_lacks_is_named_before_any_work(checkpoint, tmp_path, capsys, monkeypatch, device, words):
    import draftsmith.target

    _, drafter = checkpoint
    target_must_not_load(monkeypatch, draftsmith.target)
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--drafter", str(drafter), "--target", "smollm2", "--device", device, "--limit", "2"],
            tmp_path, before, *words)
    refused(capsys, ["run", "--out", str(tmp_path / "r"), f"eval.device={device}"], tmp_path, before, *words)


def test_check_names_a_cut_drafter_weights_file(checkpoint, tiny_target, tmp_path, capsys):
    _, drafter = checkpoint
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    before = snapshot(tmp_path)
    refused(capsys, ["check", "--target", str(tiny_target), "--drafter", str(drafter), "--engine", "vllm"], tmp_path,
            before, "cut or padded safetensors file")


# The fifth round: outputs that are their inputs, one writer per output, nothing to supervise, messages that
# name the flag and a valid example, inputs read before any work, ids given twice.

def test_eval_and_bench_refuse_an_output_that_is_their_input_even_with_overwrite(checkpoint, tiny_target, tmp_path,
                                                                                 capsys, monkeypatch):
    import draftsmith.target
    from draftsmith.bench import benchmark

    _, drafter = checkpoint
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n")
    baseline = tmp_path / "bench" / "bench.json"
    baseline.parent.mkdir()
    baseline.write_text(json.dumps({"levels": [{"concurrency": 1, "output_tokens_per_s": 10.0}]}))
    target_must_not_load(monkeypatch, draftsmith.target)
    monkeypatch.setattr(benchmark, "bench_endpoints", lambda *a, **k: pytest.fail("bench measured before refusing"))
    before = snapshot(tmp_path)
    run_eval = ["eval", "--target", str(tiny_target), "--drafter", str(drafter), "--limit", "1", "--max-new-tokens",
                "4", "--prompts", str(prompts), "--k", "2", "--overwrite"]
    refused(capsys, run_eval + ["--json", str(prompts)], tmp_path, before, "--json overlaps the source --prompts")
    refused(capsys, run_eval + ["--out", str(drafter)], tmp_path, before, "--out overlaps the source --drafter")
    refused(capsys, run_eval + ["--json", str(drafter / "config.json")], tmp_path, before, "--drafter")
    refused(capsys, ["bench", "--endpoint", "http://127.0.0.1:9", "--baseline-json", str(baseline), "--out",
                     str(baseline.parent), "--overwrite"], tmp_path, before, "--out overlaps the source --baseline-json")


def hold_in_another_process(out: Path, folder: bool = True):
    """A process that holds `out` (outputs.hold) until killed; returns it once the lock is taken."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from draftsmith.outputs import hold; "
            f"hold(Path(sys.argv[1]), 'train', folder={folder}); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_train_folder_is_written_by_one_process_and_a_killed_holder_frees_it(tiny_target, tmp_path, capsys):
    import signal

    store = tiny_store(tiny_target, tmp_path)
    out = tmp_path / "t"
    holder = hold_in_another_process(out)
    try:
        before = snapshot(tmp_path)
        refused(capsys, ["train", "--store", str(store), "--out", str(out), "--max-steps", "2", "--quiet"], tmp_path,
                before, "is in use by another draftsmith process", f"pid {holder.pid}")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert main(["train", "--store", str(store), "--out", str(out), "--max-steps", "2", "--quiet"]) == 0
    assert (out / "drafter" / "model.safetensors").is_file()


def test_a_regenerate_output_and_a_store_are_written_by_one_process(tiny_target, tmp_path, capsys):
    import signal

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n")
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    store = tmp_path / "store"
    store.mkdir()
    holders = [hold_in_another_process(tmp_path / "answers.jsonl", folder=False), hold_in_another_process(store)]
    try:
        before = snapshot(tmp_path)
        refused(capsys, ["regenerate", "--target", str(tiny_target), "--prompts", str(prompts), "--out",
                         str(tmp_path / "answers.jsonl"), "--max-new-tokens", "8"], tmp_path, before,
                f"pid {holders[0].pid}")
        refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out", str(store)],
                tmp_path, before, f"pid {holders[1].pid}")
    finally:
        for h in holders:
            os.kill(h.pid, signal.SIGKILL)
            h.wait()


def test_conversations_without_an_assistant_turn_are_refused_before_the_target_loads(tiny_target, tmp_path, capsys,
                                                                                      monkeypatch):
    import draftsmith.capture.local
    import draftsmith.train.features

    conv = tmp_path / "conv.jsonl"
    conv.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "hello"}]}) + "\n"
                            for i in range(2)))
    target_must_not_load(monkeypatch, draftsmith.capture.local, draftsmith.train.features)
    before = snapshot(tmp_path)
    refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                     str(tmp_path / "store")], tmp_path, before, "no assistant turn")
    refused(capsys, ["train", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                     str(tmp_path / "t"), "--max-steps", "2"], tmp_path, before, "no assistant turn")


def test_answers_cut_off_by_max_length_are_refused_before_a_store_is_written(tiny_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "conv.jsonl", n=2)
    before = snapshot(tmp_path)
    refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                     str(tmp_path / "store"), "--max-length", "2"], tmp_path, before, "no trainable sample")


@pytest.mark.parametrize("argv, words, wrong", [
    (["eval", "--drafter", "smollm2", "--temperature", "nan"], ("bad value for --temperature", "e.g. --temperature 0.0"),
     "3e-4"),
    (["run", "--out", "{tmp}/r", "eval.temperature=nan"], ("eval.temperature", "e.g. eval.temperature=0.0"), "3e-4"),
    (["train", "--store", "{tmp}", "--out", "{tmp}/t", "--family", "medusa"],
     ("expected: one of eagle3, dflash", "e.g. --family eagle3"), "Literal"),
    (["run", "--out", "{tmp}/r", "train.family=medusa"], ("one of eagle3, dflash", "e.g. train.family=eagle3"),
     "1,2,3"),
    (["run", "--out", "{tmp}/r", "skip=everything"], ("unknown stage 'everything'", "skip among regenerate, capture"),
     "the values named above"),
])
def test_a_bad_value_names_its_flag_the_choices_and_a_valid_example(tmp_path, capsys, argv, words, wrong):
    before = snapshot(tmp_path)
    err = refused(capsys, [a.format(tmp=tmp_path) for a in argv], tmp_path, before, *words)
    assert wrong not in err


def test_bench_reads_its_baseline_json_before_any_request(tmp_path, capsys, monkeypatch):
    from draftsmith.bench import benchmark

    monkeypatch.setattr(benchmark, "bench_endpoints", lambda *a, **k: pytest.fail("bench measured before refusing"))
    diary = tmp_path / "diary.txt"
    diary.write_text("dear diary\n")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"levels": []}))
    before = snapshot(tmp_path)
    for baseline in (diary, empty):
        refused(capsys, ["bench", "--endpoint", "http://127.0.0.1:9", "--baseline-json", str(baseline)], tmp_path,
                before, "cannot read the baseline JSON", baseline.name)


def test_an_id_given_twice_is_refused_naming_both_lines(tiny_target, tmp_path, capsys, monkeypatch):
    import draftsmith.capture.local

    conv = write_conversations(tmp_path / "conv.jsonl", n=3)
    lines = conv.read_text().splitlines()
    conv.write_text("\n".join(lines + [lines[1]]) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"question {n}"}) + "\n"
                               for n, i in enumerate(["a", "b", "a"])))
    target_must_not_load(monkeypatch, draftsmith.capture.local)
    before = snapshot(tmp_path)
    refused(capsys, ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out",
                     str(tmp_path / "store")], tmp_path, before, "'c1' appears twice", "lines 2 and 4")
    refused(capsys, ["regenerate", "--target", str(tiny_target), "--prompts", str(prompts), "--out",
                     str(tmp_path / "a.jsonl")], tmp_path, before, "'a' appears twice", "lines 1 and 3")


# --- the fifth probe's WEAK cases -------------------------------------------------------------------------

def test_a_capture_of_a_complete_store_says_nothing_was_done_not_a_rate(tiny_target, tmp_path, capsys):
    conv = write_conversations(tmp_path / "conv.jsonl", n=3)
    base = ["capture", "--target", str(tiny_target), "--conversations", str(conv), "--out", str(tmp_path / "store")]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "all 3 samples already stored" in out and "tok/s" not in out


def test_a_batch_or_row_length_past_int32_is_refused(tmp_path, capsys):
    (tmp_path / "store").mkdir()
    before = snapshot(tmp_path)
    for flag in ("--batch-tokens", "--row-tokens"):
        refused(capsys, ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "t"), flag,
                         "99999999999999999999"], tmp_path, before, flag)


def test_a_run_reports_no_data_summary_from_a_conversations_file_no_stage_wrote(tmp_path):
    """run --overwrite into a folder holding the user's conversations.jsonl with every stage skipped: the report
    does not read (and fail on) a file no stage of the run wrote."""
    from draftsmith.run.report import data_summary

    (tmp_path / "conversations.jsonl").write_text('{"mine": 1}\n')
    assert data_summary(tmp_path, None) is None
    (tmp_path / "stages.json").write_text(json.dumps({"regenerate": {"hash": "h", "complete": True}}))
    with pytest.raises(Exception):  # a stage of the run wrote it: its content is read (and here refused)
        data_summary(tmp_path, None)


# --- the sixth probe's cases --------------------------------------------------------------------------------

def test_an_empty_prompt_file_is_refused_not_scored(tmp_path, capsys):
    """eval on an empty prompts file reported tau 1.00 and a recommended k, exit 0."""
    (tmp_path / "empty.jsonl").write_text("")
    before = snapshot(tmp_path)
    refused(capsys, ["eval", "--drafter", "smollm2", "--prompts", str(tmp_path / "empty.jsonl"), "--limit", "2"],
            tmp_path, before, "holds no prompts")


def test_a_ttt_depth_past_32_is_refused(tmp_path, capsys):
    """--ttt-steps 100000 was accepted and the first step never ended."""
    (tmp_path / "store").mkdir()
    before = snapshot(tmp_path)
    refused(capsys, ["train", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "t"), "--ttt-steps",
                     "100000"], tmp_path, before, "--ttt-steps", "<= 32")


def test_regenerate_out_dot_is_a_named_error(tmp_path, capsys, monkeypatch):
    """`--out .` ended in a ValueError traceback (a path with no name)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a question"}) + "\n")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    refused(capsys, ["regenerate", "--endpoint", "http://127.0.0.1:9/v1", "--prompts", str(prompts), "--out", "."],
            tmp_path, before, "names a folder")


def test_convert_takes_a_shipped_drafters_short_name(tmp_path, capsys):
    """export and eval take `smollm2`; convert said it had no config.json."""
    assert main(["convert", "smollm2", str(tmp_path / "ds"), "--to", "draftsmith", "--target", "smollm2"]) == 0
    assert (tmp_path / "ds" / "model.safetensors").is_file()


def test_a_resumed_train_keeps_one_metrics_row_per_step(tmp_path):
    """After kill -9 at step 12 with the last checkpoint at 10, the rerun logged steps 11 and 12 again beside the
    lost run's rows. The rows after the checkpoint (and a row the kill cut) go; the start eval stays."""
    from draftsmith.train.trainer import drop_rows_after

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"eval": {"tau": {}}, "start": True}] + [{"step": s, "loss": 1.0} for s in range(1, 13)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 13, "lo')
    drop_rows_after(metrics, 10)
    kept = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert kept[0] == rows[0] and [r["step"] for r in kept[1:]] == list(range(1, 11))
