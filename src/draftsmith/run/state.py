"""`draftsmith run`'s state: `<run>/stages.json`, each stage's settings hash, its outputs and why it is skipped.

A stage's hash covers its settings and everything upstream; a rerun skips a finished stage with an unchanged
hash and wipes the outputs of one whose settings changed. Only what the run wrote is wiped: a stage's outputs
go only when `stages.json` records that the run started that stage; an output of a stage it never started is
not the run's (`unrecorded_outputs`, refused before the first stage).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.files import read_json
from draftsmith.run.settings import ENGINE_STAGES, EXPORT_FORMATS, RunConfig

STATE_FILE = "stages.json"


def stage_hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class RunState:
    """`stages.json`: per stage, the hash it ran with and whether it finished."""

    path: Path
    done: dict = field(default_factory=dict)

    @classmethod
    def load(cls, out: Path) -> RunState:
        """The run's record; none yet: empty.

        Raises:
            DraftsmithError: a record that is not JSON, or whose entries are not stage: {hash, complete}.
        """
        path = out / STATE_FILE
        if not path.exists():
            return cls(path)
        fix = f"restore {path}, or start over: pass another --out (every stage then runs again)"
        done = read_json(path, "the run's stage record", fix=fix)
        if bad := [stage for stage, entry in done.items() if not isinstance(entry, dict)]:
            raise DraftsmithError(f"the run's stage record {path} is malformed", got=f"stage {bad[0]}: "
                                  f"{json.dumps(done[bad[0]])[:80]}", expected='{"STAGE": {"hash": ..., "complete": '
                                  'true|false}, ...}', fix=fix)
        return cls(path, done)

    def started(self, stage: str) -> bool:
        """The run started `stage` before (so what lies at its outputs is the run's)."""
        return stage in self.done

    def finished(self, stage: str, h: str) -> bool:
        entry = self.done.get(stage) or {}
        return entry.get("hash") == h and bool(entry.get("complete"))

    def start(self, stage: str, h: str, outputs: list[Path]) -> bool:
        """Record a start; True when it resumes an interrupted run of the same settings. Started before with
        other settings: wipe the outputs that run wrote first."""
        if (self.done.get(stage) or {}).get("hash") == h:
            return True
        if self.started(stage):
            remove(outputs)
        self.done[stage] = {"hash": h, "complete": False}
        self.save()
        return False

    def finish(self, stage: str, h: str) -> None:
        self.done[stage] = {"hash": h, "complete": True}
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.done, indent=2) + "\n")


def remove(paths: list[Path]) -> None:
    for target in paths:
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def is_run_dir(out: Path) -> bool:
    """`out` holds a run's own record (a run directory from before the marker counts as the run's)."""
    return (Path(out) / STATE_FILE).is_file()


def unrecorded_outputs(out: Path, state: RunState, stages: list[str], cfg: RunConfig) -> list[Path]:
    """The outputs present for `stages` that the run never started: files of someone else's, in the way."""
    return [p for stage in stages if not state.started(stage) for p in stage_outputs(out, stage, cfg) if p.exists()]


def stage_outputs(out: Path, stage: str, cfg: RunConfig) -> list[Path]:
    return {
        "regenerate": [out / "conversations.jsonl", out / "regenerate.json"],
        "capture": [out / "store"],
        "train": [out / "train"],
        "export": [out / f"export-{f}" for f in EXPORT_FORMATS],
        "eval": [out / "eval.json"],
        "check": [out / "check.json"],
        "launch": [out / "launch.json", out / "launch.log"],
        "guard": [out / "guard.json"],
        "bench": [out / "bench", out / "export-llamacpp"],  # bench writes the GGUF export llama.cpp serves
    }[stage]


def bench_engines(cfg: RunConfig, python: Path | None) -> tuple[str, ...]:
    """The engines the bench stage measures: vLLM when its interpreter is there, llama.cpp when bench.llamacpp_k."""
    return tuple(name for name, on in (("vllm", python is not None), ("llamacpp", bool(cfg.bench.llamacpp_k))) if on)


def stage_settings(cfg: RunConfig, stage: str, python: Path | None) -> Any:
    """What a stage's hash covers besides everything upstream of it (bench: also the engines it measures, so a
    bench that ran without vLLM runs again once vLLM is there)."""
    if stage == "regenerate":
        return [cfg.target, cfg.regenerate.model_dump()]
    section = getattr(cfg, "launch" if stage == "guard" else stage).model_dump()  # the guard measures launch's server
    if stage in ("check", "launch", "guard"):  # both use the largest k that bench measures (RunContext.engine_ks)
        return [section, cfg.engine_python, max(cfg.bench.k)]
    return [section, cfg.engine_python, bench_engines(cfg, python)] if stage == "bench" else section


def skip_reason(cfg: RunConfig, stage: str, python: Path | None) -> str | None:
    if stage in cfg.skip:
        return "skip in the config"
    if stage == "guard" and "launch" in cfg.skip:
        return "launch is skipped: no server to measure"
    if stage == "capture" and cfg.train.mode == "online":
        return "train.mode=online: the target runs in the training process"
    no_vllm = "no vLLM interpreter (run `make engine-venv` or set engine_python)"
    if stage == "bench":  # measures llama.cpp without vLLM
        return None if bench_engines(cfg, python) else no_vllm + ", and bench.llamacpp_k is []"
    return no_vllm if stage in ENGINE_STAGES and python is None else None
