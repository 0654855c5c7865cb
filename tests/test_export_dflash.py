"""DFlash drafters through `export` and `convert`: the vLLM layout, the speculators `dflash` format, the z-lab and
speculators layouts read back, and what each refuses. Small random SmolLM2 drafters (tests/dflash_fixtures.py).
The llama.cpp GGUF goes through the vendored converter (e2e tier)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_fixtures import BLOCK, BOUNDARY, MASK, dflash_tensors, fixture_config, write_dflash, write_folder, write_published
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import export

# What vLLM's DFlash path reads from config.json (qwen3_dflash.py, configs/eagle.py, llm_base_proposer.py) plus the
# Qwen3 backbone keys transformers' Qwen3Config takes, and draftsmith's own nested block.
VLLM_KEYS = {"architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
             "rope_scaling", "max_position_embeddings", "vocab_size", "attention_bias", "tie_word_embeddings",
             "torch_dtype", "target_hidden_size", "block_size", "dflash_config", "draftsmith"}
# Keys that would change what vLLM runs: causality, sliding layers, and aux ids that win over target_layer_ids.
ENGINE_TRIPS = {"is_causal", "layer_types", "use_sliding_window", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                "n_predict"}


def test_the_vllm_export_is_vllms_dflash_layout_with_the_trained_layers_shifted(tmp_path):
    src = write_dflash(tmp_path / "d", layers=2, eagle_aux_hidden_state_layer_ids=[9, 9, 9], layer_types=["full_attention"] * 2)
    out = export(src, tmp_path / "vllm", "vllm", "float32", None)
    config = json.loads((out / "config.json").read_text())
    assert set(config) <= VLLM_KEYS and not set(config) & ENGINE_TRIPS
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [b - 1 for b in BOUNDARY]}
    assert config["block_size"] == BLOCK and config["rope_theta"] == 100000.0
    assert config["draftsmith"]["drafter"]["family"] == "dflash"
    src_t, out_t = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(out_t) == set(src_t) and all(torch.equal(src_t[k], out_t[k]) for k in src_t)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in out_t)
    card = (out / "README.md").read_text()
    assert "DFlash" in card and f"block of {BLOCK}" in card
    assert json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": BLOCK - 1}) in card


def test_the_vllm_export_loads_as_a_qwen3_config_transformers_keeps_dflash_config_in(tmp_path):
    from transformers import AutoConfig

    out = export(write_dflash(tmp_path / "d"), tmp_path / "vllm", "vllm", "bfloat16", 3)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == "qwen3" and cfg.dflash_config["target_layer_ids"] == [1, 14, 26]
    assert not getattr(cfg, "is_causal", None)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_k_past_one_block_is_refused_before_anything_is_written(tmp_path):
    src = write_dflash(tmp_path / "d", block=4)
    with pytest.raises(DraftsmithError) as e:
        export(src, tmp_path / "out", "vllm", "float32", 4)
    assert "block_size - 1 = 3" in str(e.value) and not (tmp_path / "out").exists()
    assert "num_speculative_tokens\": 3" in (export(src, tmp_path / "ok", "vllm", "float32", 3) / "README.md").read_text()


def test_a_mask_hidden_tensor_vllm_would_assert_on_is_refused_with_the_fix(tmp_path):
    src = write_dflash(tmp_path / "d")
    tensors = load_file(str(src / "model.safetensors")) | {"mask_hidden": torch.zeros(3 * 576)}
    write_folder(src, json.loads((src / "config.json").read_text()), tensors)
    with pytest.raises(DraftsmithError) as e:
        export(src, tmp_path / "out", "vllm", "float32", None)
    assert "mask_hidden" in str(e.value) and "drop it" in str(e.value)


def test_an_fc_not_n_aux_times_the_target_hidden_wide_is_refused(tmp_path):
    src = write_dflash(tmp_path / "d")
    write_folder(src, json.loads((src / "config.json").read_text()), dflash_tensors(n_aux=2))
    with pytest.raises(DraftsmithError) as e:
        export(src, tmp_path / "out", "vllm", "float32", None)
    assert "fc.weight [576, 1152] (config: [576, 1728])" in str(e.value)


def test_sglang_has_no_dflash_writer(tmp_path):
    with pytest.raises(DraftsmithError) as e:
        export(write_dflash(tmp_path / "d"), tmp_path / "out", "sglang", "float32", None)
    assert "no DFlash writer" in str(e.value)


def test_the_speculators_export_follows_speculators_dflash_config_and_stays_non_causal_in_vllm(tmp_path):
    out = export(write_dflash(tmp_path / "d"), tmp_path / "spec", "speculators", "float32", 5, "smollm2-path")
    config = json.loads((out / "config.json").read_text())
    # speculators 0.9.0 DFlashSpeculatorConfig's own fields (models/dflash/config.py) and its base's
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == list(BOUNDARY)
    assert config["mask_token_id"] == MASK and config["block_size"] == BLOCK and config["draft_vocab_size"] == 49152
    assert config["sample_from_anchor"] is False
    # vLLM's update_dflash: dflash_config.causal = not sliding_window_non_causal -> false, non-causal as trained
    assert config["sliding_window_non_causal"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"]["name_or_path"] == "smollm2-path"
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["rope_theta"] == 100000.0 and "dflash_config" not in layer


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_an_export_converts_back_to_the_same_drafter(tmp_path, fmt):
    from draftsmith.export.convert import convert

    src = write_dflash(tmp_path / "d", layers=2)
    out = export(src, tmp_path / fmt, fmt, "float32", None)
    back = convert(out, tmp_path / "back", "draftsmith")
    assert back.layout == ("speculators" if fmt == "speculators" else "draftsmith")
    assert back.aux_layer_ids_boundary == BOUNDARY
    a, b = json.loads((src / "config.json").read_text()), json.loads((back.out / "config.json").read_text())
    assert b["dflash_config"] == a["dflash_config"] and b["block_size"] == a["block_size"]
    assert b["draftsmith"]["drafter"]["family"] == "dflash"
    src_t, back_t = load_file(str(src / "model.safetensors")), load_file(str(back.out / "model.safetensors"))
    assert set(back_t) == set(src_t) and all(torch.equal(src_t[k], back_t[k]) for k in src_t)


def test_a_zlab_checkpoint_converts_with_its_layer_output_ids_as_boundaries(tmp_path):
    from draftsmith.export.convert import convert

    src = write_published(tmp_path / "zlab", "dflash_zlab_config")
    r = convert(src, tmp_path / "ds", "draftsmith", target="smollm2")
    assert r.layout == "zlab" and r.aux_layer_ids_boundary == (2, 15, 27)
    config = json.loads((r.out / "config.json").read_text())
    assert config["block_size"] == 16 and "layer_types" not in config and "auto_map" not in config
    assert config["draftsmith"]["drafter"]["family"] == "dflash" and config["draftsmith"]["target"] == "smollm2"
    served = convert(src, tmp_path / "v", "vllm", target="smollm2")
    assert json.loads((served.out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 14, 26]


def test_a_speculators_checkpoint_converts_with_its_boundary_ids_and_block(tmp_path):
    from draftsmith.export.convert import convert

    r = convert(write_published(tmp_path / "spec", "dflash_speculators_config"), tmp_path / "ds", "draftsmith")
    assert r.layout == "speculators" and r.aux_layer_ids_boundary == (2, 15, 27)
    config = json.loads((r.out / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 14, 26]}
    assert config["block_size"] == 8 and config["rope_theta"] == 100000.0
    assert any("sliding_window_non_causal" in n for n in r.notes)  # trained causal in vLLM's reading: said


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}, "sliding"),
    ({"dflash_config": {"mask_token_id": 16}}, "target_layer_ids"),
    ({"is_causal": True}, "causal"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
])
def test_published_settings_draftsmiths_dflash_cannot_reproduce_are_refused_by_name(tmp_path, change, words):
    from draftsmith.export.convert import convert

    config = fixture_config("dflash_zlab_config") | change
    write_folder(tmp_path / "z", config, dflash_tensors(2, 1536))
    with pytest.raises(DraftsmithError) as e:
        convert(tmp_path / "z", tmp_path / "out", "draftsmith", target="smollm2")
    assert words in str(e.value)


def test_a_reduced_vocabulary_speculators_dflash_is_refused(tmp_path):
    from draftsmith.export.convert import convert

    config = fixture_config("dflash_speculators_config") | {"draft_vocab_size": 8192}
    write_folder(tmp_path / "s", config, dflash_tensors(1, 1536) | {"lm_head.weight": torch.zeros(8192, 576),
                                                                     "d2t": torch.zeros(8192, dtype=torch.int64)})
    with pytest.raises(DraftsmithError) as e:
        convert(tmp_path / "s", tmp_path / "out", "draftsmith")
    assert "draft_vocab_size 8192" in str(e.value)


@pytest.mark.e2e
def test_the_llamacpp_export_writes_a_dflash_gguf_with_the_trained_layers_block_and_mask(tmp_path):
    from draftsmith.engines.llamacpp import read_gguf
    from draftsmith.target import resolve_target

    (tmp_path / "t.gguf").write_bytes(b"")  # the user's own target GGUF: recorded, not converted
    out = export(write_dflash(tmp_path / "d", block=6), tmp_path / "gguf", "llamacpp", "float32", None,
                 str(resolve_target("smollm2")), target_gguf=str(tmp_path / "t.gguf"))
    meta = read_gguf(out / "drafter-f32.gguf")
    assert (meta.arch, meta.target_layers, meta.block_size, meta.mask_token_id) == ("dflash", BOUNDARY, 6, MASK)
    manifest = json.loads((out / "llamacpp.json").read_text())
    assert manifest["k"] == 5 and "draft-dflash" in manifest["serve"]
