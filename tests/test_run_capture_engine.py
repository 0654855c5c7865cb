"""`run`'s capture stage names its engine: `capture.engine: vllm` routes the stage to engine capture."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from draftsmith.run import stages
from draftsmith.errors import DraftsmithError
from draftsmith.run.settings import RunConfig, apply_override, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_kimi_config_captures_through_a_tp8_vllm_replica():
    c = load_config(CONFIGS / "kimi-k2.5.yaml")
    assert (c.capture.engine, c.capture.tensor_parallel, c.train.mode) == ("vllm", 8, "offline")
    assert c.capture.endpoint == "http://kimi-capture:8000"


@pytest.mark.parametrize("overrides, problem", [
    (["capture.engine=sglang"], "capture.engine: 'sglang' is not transformers or vllm"),
    (["capture.tensor_parallel=8"], "capture.tensor_parallel: only with capture.engine: vllm"),
    (["capture.engine=vllm", "train.mode=online"], "train.mode online skips the capture stage"),
])
def test_engine_settings_that_cannot_work_are_named(overrides, problem):
    cfg = RunConfig()
    with pytest.raises(DraftsmithError, match="bad run config") as err:
        for o in overrides:
            cfg = apply_override(cfg, o)
    assert problem in err.value.got


def test_the_capture_stage_takes_the_engine_path_with_the_configs_settings(monkeypatch, tmp_path):
    import draftsmith.capture.local
    import draftsmith.capture.vllm

    calls: dict[str, tuple] = {}
    monkeypatch.setattr(draftsmith.capture.vllm, "engine_capture", lambda *a, **kw: calls.setdefault("engine", (a, kw)))
    monkeypatch.setattr(draftsmith.capture.local, "capture", lambda *a, **kw: calls.setdefault("transformers", (a, kw)))
    cfg = RunConfig()
    for o in ("capture.engine=vllm", "capture.tensor_parallel=2", "capture.endpoint=http://127.0.0.1:9", "capture.concurrency=7"):
        cfg = apply_override(cfg, o)
    python = tmp_path / "vllm-python"
    with contextlib.ExitStack() as stack:
        stages.do_capture(stages.RunContext(cfg, tmp_path, python, stack))
    assert set(calls) == {"engine"}, "engine vllm must not run the in-process capture"
    (conversations, store, settings, target), kw = calls["engine"]
    assert (conversations, store, target) == (tmp_path / "conversations.jsonl", tmp_path / "store", cfg.target)
    assert (settings.tensor_parallel, settings.concurrency, settings.python) == (2, 7, python)
    assert settings.hs_dir == (tmp_path / "store" / "engine" / "hs").resolve()
    assert kw["endpoint"] == "http://127.0.0.1:9" and kw["max_length"] == cfg.capture.max_length

    calls.clear()
    with contextlib.ExitStack() as stack:
        stages.do_capture(stages.RunContext(RunConfig(), tmp_path, None, stack))
    assert set(calls) == {"transformers"}, "the default engine is the in-process capture, as before"
