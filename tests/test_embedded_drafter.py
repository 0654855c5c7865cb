"""The drafter shipped for the embedded target: found by its short name, loadable, and what `run` starts from."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.model.checkpoint import EMBEDDED_DRAFTERS, drafter_path, load_drafter
from draftsmith.train.settings import starting_drafter


def test_the_short_name_resolves_to_the_shipped_drafter_and_other_names_are_unchanged(tmp_path):
    assert drafter_path("smollm2") == EMBEDDED_DRAFTERS / "smollm2"
    assert drafter_path(tmp_path) == tmp_path
    assert str(drafter_path("no-such-drafter")) == "no-such-drafter"  # callers report it as a missing directory


def test_the_shipped_drafter_loads_in_bf16_with_the_embedded_targets_shapes_and_ids():
    path = drafter_path("smollm2")
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    drafter = load_drafter(path, torch.zeros(49152, 576))
    assert drafter.config.target_hidden_size == 576 and drafter.config.vocab_size == 49152
    assert drafter.fc.weight.abs().sum() > 0, "the shipped weights were not read"
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20
    build = json.loads((path / "build.json").read_text())
    assert build["command"].startswith("GGUF=") and build["data"]["conversations"] > 30000


def test_the_shipped_drafter_is_normed_with_trained_norms_and_the_targets_head_rows():
    """The shipped drafter is normed: norm_before_fc and norm_before_residual, served by vLLM and llama.cpp, not SGLang."""
    from draftsmith.model.checkpoint import drafter_block
    from draftsmith.conventions import unread_by_format

    path = drafter_path("smollm2")
    norms = drafter_block(json.loads((path / "config.json").read_text()))
    assert norms["norm_before_fc"] and norms["norm_before_residual"] and not norms["norm_output"]
    assert unread_by_format(path, ("vllm", "llamacpp", "sglang")) == {"sglang": ["norm_before_fc", "norm_before_residual"]}
    drafter = load_drafter(path, torch.zeros(49152, 576))
    assert not torch.allclose(drafter.input_norm.weight.float(), torch.ones(1728)), "the fc norm was not trained"


def test_run_starts_from_the_shipped_drafter_only_for_its_own_target_and_engines_that_compute_its_norms():
    start = lambda *a: starting_drafter(*a).drafter  # noqa: E731
    assert start("auto", "smollm2") == "smollm2"
    assert start("auto", "smollm2", ("vllm", "llamacpp")) == "smollm2"
    assert start("auto", "smollm2", ("vllm", "sglang")) is None  # SGLang computes neither norm: scratch
    assert start("auto", "/models/Llama-3.1-8B-Instruct") is None
    assert start("auto", str(EMBEDDED_DRAFTERS / "smollm2")) is None  # a path is not a short name
    assert start(None, "smollm2") is None
    assert start("/my/drafter", "smollm2") == "/my/drafter"
    assert starting_drafter("auto", "smollm2", ("vllm", "sglang")).why == (
        "auto, the shipped drafter is normed and sglang does not compute its norm_before_fc, "
        "norm_before_residual")


def test_launch_replaces_a_shipped_drafters_short_name_in_vllm_and_sglang_commands():
    from draftsmith.engines.launch import with_shipped_drafters

    spec = json.dumps({"method": "eagle3", "model": "smollm2", "num_speculative_tokens": 2})
    vllm = with_shipped_drafters(["vllm", "serve", "T", "--speculative-config", spec])
    assert json.loads(vllm[-1]) == {"method": "eagle3", "model": str(EMBEDDED_DRAFTERS / "smollm2"),
                                    "num_speculative_tokens": 2}
    sglang = with_shipped_drafters(["python", "-m", "sglang.launch_server", "--speculative-draft-model-path", "smollm2"])
    assert sglang[-1] == str(EMBEDDED_DRAFTERS / "smollm2")
    other = ["vllm", "serve", "T", "--speculative-config", json.dumps({"model": "./my-drafter"})]
    assert with_shipped_drafters(other) == other


def test_a_run_config_refuses_an_explicit_normed_start_for_sglang_and_resolves_auto_to_scratch(tmp_path):
    from draftsmith.errors import DraftsmithError
    from draftsmith.run.report import start_description as described
    from draftsmith.run.settings import RunConfig, apply_override

    cfg = apply_override(RunConfig(), "export.formats=vllm,sglang")
    with pytest.raises(DraftsmithError, match="train.init_from: smollm2 has norm_before_fc, norm_before_residual"):
        apply_override(cfg, "train.init_from=smollm2")
    assert apply_override(RunConfig(), "train.init_from=smollm2").train.init_from == "smollm2"  # vllm only: fine
    doc = {"target": "smollm2", "train": {"init_from": "auto"}, "export": {"formats": ["vllm", "sglang"]}}
    assert described(doc).startswith("trained from scratch (train.init_from: auto, the shipped drafter is normed")
    assert described(dict(doc, export={"formats": ["vllm"]})).startswith("fine-tuned from `smollm2`")
    assert "no drafter is shipped" in described(dict(doc, target="/models/llama"))
