"""`draftsmith check` of DFlash drafters: facts from the facts table (which vLLM first registers DFlash), the
drafter's config and safetensors header and the GGUF header; each finding of the kind its outcome is (start error
against silent acceptance loss). Small random SmolLM2 drafters (tests/dflash_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_fixtures import dflash_tensors, write_dflash, write_folder
from draftsmith.errors import DraftsmithError
from draftsmith.preflight import check
from draftsmith.preflight.check import CheckSettings
from draftsmith.target import resolve_target


def run(drafter: Path, engine: str = "vllm", version: str | None = "0.32.0", spec: dict | None = None, args: str = ""):
    findings, facts = check.run_checks(resolve_target("smollm2"), drafter, CheckSettings(
        engine=engine, engine_version=version, speculative_config=json.dumps(spec) if spec else None, engine_args=args))
    return {f.rule: f for f in findings if f.severity != "ok"}, {f.rule for f in findings if f.severity == "ok"}, facts


def spec(drafter: Path, k: int | None = 3) -> dict:
    return {"method": "dflash", "model": str(drafter)} | ({"num_speculative_tokens": k} if k else {})


def test_an_exported_dflash_drafter_passes_with_the_trained_layers_and_a_k_inside_the_block(tmp_path):
    d = write_dflash(tmp_path / "d")
    bad, ok, facts = run(d, spec=spec(d, 7))
    assert not bad, {r: f.message for r, f in bad.items()}
    assert {"vllm-dflash.no-dflash", "vllm-dflash.fc-width", "vllm-dflash.capture-differs", "vllm-dflash.causal",
            "vllm-dflash.k-past-block"} <= ok
    assert facts["dflash_captured"] == [2, 15, 27] and facts["dflash_first_release"] == "0.20.0"


def test_a_release_before_dflash_is_a_start_error_naming_the_first_release(tmp_path):
    d = write_dflash(tmp_path / "d")
    bad, _, _ = run(d, version="0.19.1", spec=spec(d))
    assert bad["vllm-dflash.no-dflash"].kind == "start" and ">= 0.20.0" in bad["vllm-dflash.no-dflash"].fix


def test_no_num_speculative_tokens_is_a_start_error_and_k_past_the_block_a_silent_loss(tmp_path):
    d = write_dflash(tmp_path / "d", block=4)
    bad, _, _ = run(d, spec=spec(d, None))
    assert bad["vllm-dflash.num-speculative-tokens"].severity == "error"
    assert '"num_speculative_tokens": 3' in bad["vllm-dflash.num-speculative-tokens"].fix
    bad, _, _ = run(d, spec=spec(d, 5))
    assert bad["vllm-dflash.k-past-block"].kind == "accept" and "vllm-dflash.num-speculative-tokens" not in bad


def test_eagle_ids_that_win_over_target_layer_ids_are_a_silent_loss(tmp_path):
    d = write_dflash(tmp_path / "d", eagle_aux_hidden_state_layer_ids=[1, 14, 26])  # layer-output ids as boundaries
    bad, _, facts = run(d, spec=spec(d))
    assert facts["dflash_captured"] == [1, 14, 26] and bad["vllm-dflash.capture-differs"].kind == "accept"
    assert "start" not in {f.kind for f in bad.values() if f.severity == "error"}


def test_target_layer_ids_past_the_target_and_a_narrow_fc_are_start_errors(tmp_path):
    d = write_dflash(tmp_path / "d", boundary=(2, 15, 31))
    bad, _, _ = run(d, spec=spec(d))
    assert "31" in bad["vllm-dflash.layers-past-target"].message
    d2 = write_dflash(tmp_path / "d2")
    write_folder(d2, json.loads((d2 / "config.json").read_text()), dflash_tensors(n_aux=2))
    bad, _, _ = run(d2, spec=spec(d2))
    assert bad["vllm-dflash.fc-width"].kind == "start"
    assert "expects 1152 concatenated aux hidden features but received 1728" in bad["vllm-dflash.fc-width"].engine_text


V1 = "VLLM_USE_V2_MODEL_RUNNER=0"  # what the CPU build always runs


@pytest.mark.parametrize("change, rule, kind", [
    ({"is_causal": True}, "vllm-dflash.causal", "accept"),
    ({"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2}, "vllm-dflash.mixed-sliding", "start"),
    ({"architectures": ["DFlash2DraftModel"]}, "vllm-dflash.candidate-heads", "start"),
    ({"dflash_config": {"target_layer_ids": [1, 14, 26], "mask_token_id": 49152}}, "vllm-dflash.mask-outside-vocab", "serve"),
    ({"dflash_config": {"target_layer_ids": [1, 14, 26]}}, "vllm-dflash.mask-missing", "start"),
])
def test_what_v1_refuses_and_what_runs_silently_wrong_are_named_by_outcome(tmp_path, change, rule, kind):
    layers = change.get("num_hidden_layers", 1)
    d = write_dflash(tmp_path / "d", layers=layers, **change)
    bad, _, _ = run(d, spec=spec(d), args=V1)
    assert bad[rule].kind == kind, {r: f.message for r, f in bad.items()}


def test_mixed_sliding_layers_and_candidate_heads_start_on_the_v2_runner(tmp_path):
    d = write_dflash(tmp_path / "d", layers=2, architectures=["DFlash2DraftModel"],
                     layer_types=["sliding_attention", "full_attention"])
    bad, _, _ = run(d, spec=spec(d), args="VLLM_USE_V2_MODEL_RUNNER=1")
    assert not {"vllm-dflash.mixed-sliding", "vllm-dflash.candidate-heads"} & set(bad)
    bad, _, _ = run(d, spec=spec(d), args=V1)
    assert {"vllm-dflash.mixed-sliding", "vllm-dflash.candidate-heads"} <= set(bad)


def test_a_speculators_config_with_sliding_window_non_causal_false_runs_causal_in_vllm(tmp_path):
    from draftsmith.export.formats import export

    out = export(write_dflash(tmp_path / "d"), tmp_path / "s", "speculators", "float32", 3)
    bad, ok, _ = run(out, spec=spec(out))
    assert "vllm-dflash.causal" in ok and not bad
    config = json.loads((out / "config.json").read_text()) | {"sliding_window_non_causal": False}
    (out / "config.json").write_text(json.dumps(config))
    bad, _, _ = run(out, spec=spec(out))
    assert bad["vllm-dflash.causal"].kind == "accept"
    bad, _, _ = run(out, version="0.19.1", spec=spec(out))
    assert "vllm-dflash.no-speculators-dflash" in bad


def test_mask_hidden_and_a_causal_only_backend_are_start_errors(tmp_path):
    d = write_dflash(tmp_path / "d")
    write_folder(d, json.loads((d / "config.json").read_text()),
                 load_file(str(d / "model.safetensors")) | {"mask_hidden": torch.zeros(1728)})
    bad, _, _ = run(d, spec=spec(d), args="--attention-backend TREE_ATTN")
    assert bad["vllm-dflash.mask-hidden"].kind == "start" and "mask_hidden" in bad["vllm-dflash.mask-hidden"].engine_text
    assert bad["vllm-dflash.non-causal-backend"].kind == "start"
    bad, _, _ = run(d, spec=spec(d), args="--attention-backend FLASH_ATTN")
    assert "vllm-dflash.non-causal-backend" not in bad


def test_no_assumed_spec_assumes_the_whole_block(tmp_path):
    bad, _, facts = run(write_dflash(tmp_path / "d", block=6))
    assert facts["spec_num_tokens"] == 5 and not bad


def test_sglang_is_refused_for_a_dflash_drafter(tmp_path):
    with pytest.raises(DraftsmithError):
        run(write_dflash(tmp_path / "d"), engine="sglang", version=None)


def test_llamacpp_reads_the_gguf_header_block_layers_mask_and_the_clamp(tmp_path):
    from gguf import GGUFWriter

    d = write_dflash(tmp_path / "d", block=8)
    w = GGUFWriter(str(d / "drafter-f32.gguf"), "dflash")
    w.add_array("dflash.target_layers", [2, 15, 27])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    bad, ok, _ = run(d, engine="llamacpp", version="0.3.36", args="--spec-draft-n-max 20")
    assert bad["llamacpp-dflash.mask-token"].kind == "start"
    assert bad["llamacpp-dflash.block-size"].kind == "accept" and "16" in bad["llamacpp-dflash.block-size"].message
    assert bad["llamacpp-dflash.n-max-clamped"].kind == "accept" and "= 15" in bad["llamacpp-dflash.n-max-clamped"].message
    assert "llamacpp-dflash.layers-differ" in ok
