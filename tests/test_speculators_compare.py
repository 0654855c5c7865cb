"""benchmarks/speculators_compare.py, the parts that run without a GPU or speculators: the settings map,
the argv, the convert of speculators' checkpoint folders, and the message when speculators is absent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CFG
from draftsmith.train.settings import TrainConfig
from public_layouts import write_speculators_trained

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speculators_compare as cmp  # noqa: E402

TRAIN_DEFAULTS = {name: f.default for name, f in TrainConfig.model_fields.items()}


def flags(argv: list[str]) -> dict[str, list[str]]:
    """--flag v1 v2 ... -> {flag: [v1, v2]}; a bare --flag -> []."""
    out: dict[str, list[str]] = {}
    for a in argv:
        if a.startswith("--"):
            out[a] = []
            key = a
        else:
            out[key].append(a)
    return out


def test_settings_table_holds_draftsmiths_real_defaults():
    for s in cmp.SETTINGS:
        if not s.fixed[0] and s.draftsmith not in cmp.PER_RUN:
            assert TRAIN_DEFAULTS[s.draftsmith] == s.draftsmith_default, f"{s.draftsmith}: table out of date"


def test_speculators_matched_gets_draftsmiths_values():
    argv = cmp.speculators_argv("speculators-matched", Path("/d"), Path("/t"), Path("/w/ckpt"), [2, 15, 27], 1.5, 8192)
    f = flags(argv)
    assert f["--ttt-steps"] == [str(TRAIN_DEFAULTS["ttt_steps"])] and f["--ttt-step-loss-decay"] == ["0.8"]
    assert f["--lr"] == [str(TrainConfig(store="s", out="o").peak_lr)] and f["--total-seq-len"] == [str(TRAIN_DEFAULTS["batch_tokens"])]
    assert f["--train-data-ratio"] == ["0.95"] and f["--optimizer"] == ["adamw"] and f["--scheduler-type"] == ["cosine"]
    assert {"--norm-before-fc", "--no-norm-output", "--norm-before-residual"} <= set(f)  # the normed recipe
    assert f["--full-attention-indices"] == ["0"] and f["--draft-vocab-size"] == ["8192"]
    assert f["--target-layer-ids"] == ["2", "15", "27"]  # speculators reads boundary ids as is
    assert f["--epochs"] == ["2"]  # whole epochs only


def test_speculators_defaults_run_sets_nothing_but_data_paths_ids_length_and_the_eager_loss():
    f = flags(cmp.speculators_argv("speculators-defaults", Path("/d"), Path("/t"), Path("/w/c"), [2, 15, 27], 1, 64))
    assert set(f) == {"--speculator-type", "--verifier-name-or-path", "--data-path", "--save-path", "--log-dir",
                      "--target-layer-ids", "--epochs", "--on-missing", "--loss-implementation"}
    assert f["--loss-implementation"] == ["eager"]  # the fused loss fails under torch 2.11's compile (SPECULATORS_LOSS)


def test_speculators_defaults_attends_fully_only_where_its_window_cannot_bind():
    def argv(longest):
        return flags(cmp.speculators_argv("speculators-defaults", Path("/d"), Path("/t"), Path("/w/c"), [2, 15, 27],
                                          1, 64, longest))
    assert argv(cmp.SPECULATORS_WINDOW)["--full-attention-indices"] == ["0"]
    assert "--full-attention-indices" not in argv(cmp.SPECULATORS_WINDOW + 1)


def test_draftsmith_matched_builds_a_train_config_with_speculators_defaults(tmp_path):
    values = cmp.draftsmith_values("draftsmith-matched", tmp_path / "s", tmp_path / "o", 1.0, 49152)
    cfg = TrainConfig(**values)
    assert (cfg.ttt_steps, cfg.step_loss_decay, cfg.lr, cfg.batch_tokens) == (3, 1.0, 1e-3, 8192)
    assert cfg.eval_fraction == pytest.approx(0.1) and cfg.clip == 1.0 and cfg.draft_vocab_size == 49152
    assert cfg.warmup_ratio == 0.01  # speculators' unset warm-up: 1 % of the steps
    assert TrainConfig(**cmp.draftsmith_values("draftsmith-defaults", tmp_path / "s", tmp_path / "o", 1.0, 96)) \
        == TrainConfig(store=str(tmp_path / "s"), out=str(tmp_path / "o"))


def test_speculators_own_config_resolves_both_argvs_to_the_tabled_values():
    pytest.importorskip("speculators")
    from speculators.train.config import TrainConfig as SpecConfig

    base = dict(data=Path("/d"), target=Path("/t"), save=Path("/w/c"), aux_ids=[2, 15, 27], epochs=1, draft_vocab=64)
    defaults = SpecConfig.resolve(cmp.speculators_argv("speculators-defaults", **base)).flatten()
    matched = SpecConfig.resolve(cmp.speculators_argv("speculators-matched", **base)).flatten()
    for s in cmp.SETTINGS:
        if not s.fixed[1] and s.draftsmith not in cmp.PER_RUN:
            name = s.speculators[2:].replace("-", "_")
            assert defaults[name] == s.speculators_default, f"{name}: table out of date for speculators 0.9.0"
    assert (matched["ttt_steps"], matched["ttt_step_loss_decay"], matched["optimizer"]) == (7, 0.8, "adamw")
    assert matched["norm_before_fc"] is True and matched["norm_output"] is True and matched["full_attention_indices"] == [0]


def tiny_target_config(path: Path) -> Path:
    """A config-only target the tiny drafter fits (30 layers, hidden 40, vocab 96)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 40, "intermediate_size": 80,
        "num_hidden_layers": 30, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": CFG.max_position_embeddings, "rms_norm_eps": 1e-6, "rope_theta": CFG.rope_theta}))
    return path


def test_convert_takes_speculators_last_epoch_folder(checkpoint, tmp_path):
    _, ckpt = checkpoint
    state = load_file(str(ckpt / "model.safetensors"))
    write_speculators_trained(state, CFG, tmp_path / "save" / "2")
    write_speculators_trained({**state, "norm.weight": state["norm.weight"] * 2}, CFG, tmp_path / "save" / "10")
    (tmp_path / "save" / "logs").mkdir()
    got = cmp.convert_checkpoint(tmp_path / "save", tmp_path / "out", str(tiny_target_config(tmp_path / "target")))
    assert got["ok"] and got["source"].endswith("/10"), got
    converted = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(converted["norm.weight"], (state["norm.weight"] * 2).to(torch.bfloat16))


def test_convert_refusal_is_recorded_with_its_reason(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = write_speculators_trained(load_file(str(ckpt / "model.safetensors")), CFG, tmp_path / "save" / "0")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "fc_norm": True}))  # per-chunk norms: not representable
    got = cmp.convert_checkpoint(tmp_path / "save", tmp_path / "out", str(tiny_target_config(tmp_path / "target")))
    assert not got["ok"] and "fc_norm true" in got["error"]
    (tmp_path / "none").mkdir()
    empty = cmp.convert_checkpoint(tmp_path / "none", tmp_path / "o2", None)
    assert not empty["ok"] and "no <epoch>/ folder" in empty["error"]


def test_without_speculators_the_run_stops_and_says_what_to_carry(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "speculators" else real(name, *a))
    args = cmp.build_parser().parse_args(["--store", str(tmp_path), "--only", "speculators-matched"])
    with pytest.raises(SystemExit, match="docs/peers.md"):
        cmp.run_parent(args)


def test_parser_takes_repeated_only_and_refuses_unknown_runs(capsys):
    args = cmp.build_parser().parse_args(["--store", "s", "--only", "draftsmith-defaults", "--only", "draftsmith-matched"])
    assert args.only == ["draftsmith-defaults", "draftsmith-matched"] and args.epochs == 1.0 and args.max_seconds is None
    with pytest.raises(SystemExit):
        cmp.build_parser().parse_args(["--store", "s", "--only", "eagle"])
    assert "'eagle' is not one of" in capsys.readouterr().err


def test_a_draftsmith_variant_changes_only_the_fields_it_names(tmp_path, capsys):
    args = cmp.build_parser().parse_args(["--store", "s", "--only", "draftsmith-matched+compile+lr=5e-4"])
    assert args.only == ["draftsmith-matched+compile+lr=5e-4"]
    variant = TrainConfig(**cmp.draftsmith_values(args.only[0], tmp_path / "s", tmp_path / "o", 1.0, 49152))
    matched = TrainConfig(**cmp.draftsmith_values("draftsmith-matched", tmp_path / "s", tmp_path / "o", 1.0, 49152))
    assert (variant.compile, variant.lr) == (True, 5e-4) and matched.compile is False and matched.lr == 1e-3
    assert variant.model_copy(update={"compile": False, "lr": 1e-3}) == matched
    for bad, said in (("draftsmith-defaults+no_such_field=1", "not a TrainConfig field"),
                      ("speculators-defaults+compile", "only draftsmith runs")):
        with pytest.raises(SystemExit):
            cmp.build_parser().parse_args(["--store", "s", "--only", bad])
        assert said in capsys.readouterr().err


def test_requirement_check_names_what_is_missing(monkeypatch):
    from importlib import metadata

    real_version, real_requires = metadata.version, metadata.requires
    fake = {"speculators": ("0.9.0", ["datasets<=5.1.0,>=4.0.0", "torch<=2.14.1", "mooncake>=1; extra == 'cuda'"]),
            "datasets": ("5.2.0", []), "torch": ("2.11.0", ["speculators"])}  # a cycle must not loop

    def version(name):
        if name in fake:
            return fake[name][0]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "requires", lambda name: fake[name][1])
    assert cmp.requirement_problems() == ["datasets 5.2.0 is installed, datasets<=5.1.0,>=4.0.0 is required"]
    del fake["torch"]
    assert "torch<=2.14.1 is not installed" in cmp.requirement_problems()


def test_docs_show_the_settings_table_the_benchmark_uses():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "peers.md").read_text()
    assert cmp.settings_table() in docs, "docs/peers.md: paste benchmarks/speculators_compare.py settings_table()"


def test_speculators_train_tokens_are_its_first_rows_shifted_by_one():
    # ArrowDataset: train = rows [0, int(n * ratio)); shift_batch drops one token per sample
    assert cmp.train_split_tokens([10, 20, 30, 40], 0.5) == 9 + 19
    assert cmp.train_split_tokens([10, 20, 30, 40], 0.9) == 9 + 19 + 29


def test_a_child_past_its_time_is_stopped_and_its_log_kept(tmp_path):
    log = tmp_path / "run.log"
    done = cmp.run_logged([sys.executable, "-c", "print('trained')"], log, timeout=60)
    assert (done.returncode, done.timed_out) == (0, False) and log.read_text() == "trained\n"
    slow = cmp.run_logged([sys.executable, "-c", "import time; print('step 1', flush=True); time.sleep(60)"], log, 1)
    assert slow.timed_out and slow.returncode != 0 and slow.seconds < 30 and "step 1" in log.read_text()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(cmp, "GRACE_S", 1)
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    got = cmp.run_logged([sys.executable, "-c", code], tmp_path / "log", timeout=2)
    assert got.timed_out and got.returncode == -9 and got.seconds < 30


def test_log_tail_leaves_out_progress_bars(tmp_path):
    log = tmp_path / "log"
    log.write_text("start\n\nEpoch 0  50% \u2501\u2501\u2501 1/2 [ 0:00:01 , 2.0 it/s ]\n 10%|#  | 1/10\n"
                   + "Traceback\n" + "x" * 400 + "\nRuntimeError: boom\n")
    assert cmp.log_tail(log) == ["start", "Traceback", "x" * 300, "RuntimeError: boom"]
    assert cmp.log_tail(log, 1) == ["RuntimeError: boom"] and cmp.log_tail(tmp_path / "none") == []


def test_runs_past_the_deadline_are_skipped_and_every_record_is_written_at_once(monkeypatch):
    clock = iter([0.0, 50.0, 100.0, 200.0])
    monkeypatch.setattr(cmp.time, "monotonic", lambda: next(clock))
    written: list[list[str]] = []
    records = cmp.run_all(list(cmp.RUNS), lambda name, left: {"run": name, "left": left},
                          lambda recs: written.append([r["run"] for r in recs]), deadline=120.0)
    assert [r.get("left") for r in records] == [120.0, 70.0, None, None]  # 20 s left < MIN_RUN_S: not started
    assert "skipped" in records[2] and "skipped" in records[3]
    assert written == [list(cmp.RUNS[:k]) for k in range(1, 5)]
    assert cmp.run_all(["a"], lambda name, left: {"run": name, "left": left}, lambda r: None, None)[0]["left"] is None


def test_summary_is_a_line_a_run_with_the_log_tail_of_a_failure():
    result = {"device": "cpu", "torch": "2.11.0", "num_samples": 12, "runs": [
        {"run": "speculators-defaults", "returncode": 0, "seconds": 230.7, "tokens_per_s": 9.6, "peak_gpu_mem_gib": None,
         "convert": {"ok": False, "error": "1 tensor(s) have no place\n  got: input_norm.weight"},
         "step_rate": {"steps": 362, "first_step_s": 60.7, "median_step_ms": 38.34, "median_step_tokens_per_s": 204000}},
        {"run": "speculators-matched", "returncode": -15, "seconds": 300.0, "timed_out": "stopped after 300 s",
         "log_tail": ["Traceback", "KeyboardInterrupt"]},
        {"run": "draftsmith-defaults", "skipped": "3 s left of --max-seconds"}]}
    lines = cmp.summary(result).splitlines()
    assert lines[0].startswith("== summary") and len(lines) == 6
    assert "convert refused: 1 tensor(s) have no place" in lines[1] and "got:" not in lines[1]
    assert "| step median 204,000 tok/s, first 60.7 s |" in lines[1] and "step median" not in lines[2]
    assert "stopped after 300 s" in lines[2] and lines[3:5] == ["    Traceback", "    KeyboardInterrupt"]
    assert lines[5].split() == ["draftsmith-defaults", "skipped:", "3", "s", "left", "of", "--max-seconds"]


def test_results_json_is_replaced_whole(tmp_path):
    out = tmp_path / "r" / "speculators_compare.json"
    cmp.write_json(out, {"runs": [1]})
    cmp.write_json(out, {"runs": [1, 2]})
    assert json.loads(out.read_text()) == {"runs": [1, 2]} and [p.name for p in out.parent.iterdir()] == [out.name]


def test_cpu_smoke_argv_resolves_in_speculators_own_config():
    pytest.importorskip("speculators")
    from speculators.train.config import TrainConfig as SpecConfig

    argv = cmp.speculators_argv("speculators-defaults", Path("/d"), Path("/t"), Path("/w/c"), [2, 15, 27], 1, 64)
    flat = SpecConfig.resolve([*argv, *cmp.CPU_SMOKE_ARGV]).flatten()
    assert (flat["draft_attn_impl"], flat["num_workers"], flat["loss_implementation"]) == ("sdpa", 2, "eager")
    assert SpecConfig.resolve(argv).flatten()["draft_attn_impl"] == "simple_flex_attention"  # the GPU keeps its own


def test_a_stopped_speculators_run_still_converts_the_epoch_it_saved(checkpoint, tmp_path, monkeypatch):
    _, ckpt = checkpoint
    save = tmp_path / "work" / "speculators-matched" / "checkpoints"
    write_speculators_trained(load_file(str(ckpt / "model.safetensors")), CFG, save / "0")
    (save / "interrupted").mkdir()  # what its graceful shutdown saves on SIGTERM: not an epoch

    def stopped(cmd, log, timeout):
        log.write_text("Epoch 0 100% \u2501\u2501 1/1\nValidation epoch 1/1 started\nKilled\n")
        return cmp.ChildResult(-15, True, timeout + 3)

    monkeypatch.setattr(cmp, "run_logged", stopped)
    args = cmp.build_parser().parse_args(["--store", str(tmp_path / "store"), "--max-seconds", "120"])
    record = cmp.run_one("speculators-matched", args, tmp_path / "work", tmp_path / "data",
                         tiny_target_config(tmp_path / "target"), [2, 15, 27], 96, [10, 20], timeout=100)
    assert record["timed_out"] == "stopped after 100 s, the time left of --max-seconds 120"
    assert record["log_tail"] == ["Validation epoch 1/1 started", "Killed"] and "wall_s" not in record
    assert record["convert"]["ok"] and record["convert"]["source"].endswith("/0")


def test_summary_shows_only_the_end_of_a_long_log_tail():
    tail = [f"line {k}" for k in range(25)]
    result = {"device": "cpu", "torch": "2.11.0", "num_samples": 1,
              "runs": [{"run": r, "returncode": 1, "seconds": 1.0, "log_tail": tail} for r in cmp.RUNS]}
    text = cmp.summary(result)
    assert text.count("    line") == 4 * cmp.SUMMARY_TAIL and "line 12" not in text and len(text) < 12_000


def test_concurrent_runs_all_start_before_any_ends_and_keep_their_order():
    import threading

    started, release = [], threading.Barrier(len(cmp.RUNS), timeout=10)  # every run must be in flight at once
    written: list[list[str]] = []

    def run(name, left):
        started.append(name)
        release.wait()  # a sequential run_all would block here for good (BrokenBarrierError after 10 s)
        return {"run": name, "left": left}

    records = cmp.run_all(list(cmp.RUNS), run, lambda recs: written.append([r["run"] for r in recs]),
                          deadline=None, concurrent=True)
    assert [r["run"] for r in records] == list(cmp.RUNS) and sorted(started) == sorted(cmp.RUNS)
    assert len(written) == len(cmp.RUNS) and written[-1] == list(cmp.RUNS)
    assert all(w == [n for n in cmp.RUNS if n in w] for w in written)  # each write in the order of the runs


def test_concurrent_runs_are_all_skipped_when_too_little_time_is_left(monkeypatch):
    monkeypatch.setattr(cmp.time, "monotonic", lambda: 100.0)
    records = cmp.run_all(["a", "b"], lambda name, left: pytest.fail("started"), lambda r: None,
                          deadline=100.0 + cmp.MIN_RUN_S - 1, concurrent=True)
    assert [("skipped" in r, r["run"]) for r in records] == [(True, "a"), (True, "b")]


def test_draftsmith_only_runs_do_not_export_the_store(monkeypatch, tmp_path):
    import draftsmith.capture.interop as interop

    monkeypatch.setattr(interop, "export_speculators", lambda *a, **k: pytest.fail("exported for draftsmith runs"))
    seen = []
    monkeypatch.setattr(cmp, "run_all", lambda runs, one, write, deadline, concurrent=False: seen.append(
        (runs, concurrent)) or [])
    monkeypatch.setattr("draftsmith.target.resolve_target", lambda name: tmp_path / "target")

    class Store:
        identity = {"target": {"name": "t", "vocab_size": 96}, "aux_layer_ids": [1, 2, 3]}
        manifest = {"num_tokens": 0}

        def __init__(self, path):
            pass

        def __len__(self):
            return 0

    monkeypatch.setattr("draftsmith.capture.store.FeatureStore", Store)
    args = cmp.build_parser().parse_args(["--store", str(tmp_path), "--only", "draftsmith-defaults", "--concurrent",
                                          "--out", str(tmp_path / "r.json")])
    result = cmp.run_parent(args)
    assert seen == [(["draftsmith-defaults"], True)] and result["concurrent"] is True
    assert "not throughput figures" in result["note"]


def test_step_rates_leave_out_each_trainers_first_step(tmp_path):
    """The per-step rate is the median over the steps after the first (compile and warm-up), read from
    speculators' own per-step profile lines (three lines of a real 0.9.0 log, one H200, 2026-12-03) and from
    draftsmith's metrics.jsonl; a run with one step or no log has none."""
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "train.log").write_text(
        "    profile/opt_ms=64.398, profile/step_ms=6.07e+04, profile/tokens_per_s=126.150, profile/fetch_frac=0.170,\n"
        "    profile/step_ms=215.912, profile/tokens_per_s=3.78e+04, profile/fetch_frac=0.019, profile/queue_ms=3.066,\n"
        "    progress bar 12% ━━━━━━\n"
        "    profile/step_ms=38.048, profile/tokens_per_s=2.03e+05, profile/fetch_frac=0.096, profile/queue_ms=2.716,\n")
    assert cmp.step_rates(spec, "speculators") == {"steps": 3, "first_step_s": 60.7, "median_step_ms": 126.98,
                                                   "median_step_tokens_per_s": 120400}
    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True)
    rows = [{"step": 1, "first_step_s": 19.6, "compile": True}, {"step": 1, "ms": 19624, "tok_per_s": 209},
            {"step": 2, "ms": 19, "tok_per_s": 215000}, {"step": 3, "ms": 35, "tok_per_s": 117000},
            {"step": 4, "ms": 18, "tok_per_s": 227000}, {"step": 4, "eval": {}}]
    (ds / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cmp.step_rates(ds, "draftsmith") == {"steps": 4, "first_step_s": 19.6, "median_step_ms": 19,
                                                "median_step_tokens_per_s": 215000}
    assert cmp.step_rates(tmp_path / "none", "draftsmith") is None
    assert cmp.step_rates(tmp_path / "none", "speculators") is None
