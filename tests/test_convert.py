"""`draftsmith convert`: every public layout reads back to the same tensors, config and logits; refusals.

Fixtures for the public layouts are written by `tests/public_layouts.py` (sources cited there) from a
tiny drafter after one training step, so a wrong key map, dtype, aux-id convention or norm flag changes
the tensors, the config or the logits compared here.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import CFG, drafter_logits
from draftsmith.model.checkpoint import load_drafter
from draftsmith.cli import main
from draftsmith.export.convert import convert, read_drafter
from draftsmith.errors import DraftsmithError
from draftsmith.export.formats import FORMATS, export
from public_layouts import WRITERS, write_mla, write_speculators_trained

LAYOUT_DTYPE = {"eagle": "float16", "specforge": "bfloat16", "modelopt": "bfloat16", "speculators": "bfloat16"}


def state_of(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def assert_same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_draftsmith_to_format_and_back_is_identical(checkpoint, tmp_path, fmt):
    drafter, ckpt = checkpoint
    out = export(ckpt, tmp_path / fmt, fmt, dtype="float32")
    back = convert(out, tmp_path / "back", "draftsmith").out
    assert_same_tensors(state_of(back), state_of(ckpt))
    cfg_back = json.loads((back / "config.json").read_text())
    assert cfg_back["draftsmith"]["drafter"] == json.loads((ckpt / "config.json").read_text())["draftsmith"]["drafter"]
    assert torch.equal(drafter_logits(load_drafter(back, drafter.embed_tokens.weight)), drafter_logits(drafter))


@pytest.mark.parametrize("fmt,convention", [("vllm", "boundary"), ("sglang", None), ("speculators", None)])
def test_export_without_draftsmith_block_reads_back_through_the_public_reader(checkpoint, tmp_path, fmt, convention):
    """Strip the draftsmith block: the public-layout reader alone must recover the config, ids included."""
    drafter, ckpt = checkpoint
    out = export(ckpt, tmp_path / fmt, fmt, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("draftsmith")
    (out / "config.json").write_text(json.dumps(cfg))
    back = convert(out, tmp_path / "back", "draftsmith", target_layers=30, aux_convention=convention).out
    read = json.loads((back / "config.json").read_text())["draftsmith"]
    assert read["drafter"] == CFG.to_dict() and read["aux_layer_ids_boundary"] == [2, 15, 27]
    assert torch.equal(drafter_logits(load_drafter(back, drafter.embed_tokens.weight)), drafter_logits(drafter))


def test_vllm_ids_read_in_the_layer_output_convention_shift_by_one(checkpoint, tmp_path):
    """The same file read as SpecForge writes ids (layer outputs) means one layer later: the flag matters."""
    _, ckpt = checkpoint
    out = export(ckpt, tmp_path / "v", "vllm", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("draftsmith")
    (out / "config.json").write_text(json.dumps(cfg))
    assert read_drafter(out, 30).config.aux_layer_ids == (3, 16, 28)  # detected as specforge: ids + 1
    assert read_drafter(out, 30, "boundary").config.aux_layer_ids == (2, 15, 27)


@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_public_layout_converts_to_identical_tensors_and_logits(checkpoint, tmp_path, layout):
    drafter, ckpt = checkpoint
    dtype = LAYOUT_DTYPE[layout]
    src = WRITERS[layout](state_of(ckpt), CFG, tmp_path / layout, dtype=dtype)
    r = convert(src, tmp_path / "ds", "draftsmith", target_layers=30)
    assert r.layout == layout and r.aux_layer_ids_boundary == (2, 15, 27)
    cast = getattr(torch, dtype)
    want = {k: v.to(cast) if v.is_floating_point() else v for k, v in state_of(ckpt).items()}
    assert_same_tensors(state_of(r.out), want)  # t2d included: derived from d2t for ModelOpt
    cfg = json.loads((r.out / "config.json").read_text())["draftsmith"]
    assert cfg["drafter"] == CFG.to_dict()
    assert cfg["converted_from"]["layout"] == layout
    reference = Eagle3Drafter_like(drafter, cast)
    assert torch.equal(drafter_logits(load_drafter(r.out, drafter.embed_tokens.weight)),
                       drafter_logits(reference))


def Eagle3Drafter_like(drafter, dtype):
    """The drafter with its weights rounded through `dtype` (what a bf16 / fp16 file holds), in fp32."""
    import copy

    rounded = copy.deepcopy(drafter)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(dtype).float())
    rounded.embed_tokens.weight.copy_(drafter.embed_tokens.weight)
    return rounded


@pytest.mark.parametrize("layout", sorted(WRITERS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_public_layout_to_each_export_format_matches_a_direct_export(checkpoint, tmp_path, layout, fmt):
    _, ckpt = checkpoint
    src = WRITERS[layout](state_of(ckpt), CFG, tmp_path / layout, dtype="float32")
    converted = convert(src, tmp_path / "c", fmt, target_layers=30).out
    direct = export(ckpt, tmp_path / "d", fmt, dtype="float32")
    assert_same_tensors(state_of(converted), state_of(direct))
    strip = lambda p: {k: v for k, v in json.loads((p / "config.json").read_text()).items() if k != "draftsmith"}  # noqa: E731
    assert strip(converted) == {**strip(direct), **({"speculators_config": strip(converted)["speculators_config"]}
                                                    if fmt == "speculators" else {})}


def test_speculators_without_norm_flag_is_read_as_vllm_reads_it(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["speculators"](state_of(ckpt), CFG, tmp_path / "s")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("norm_before_residual")
    (src / "config.json").write_text(json.dumps(cfg))
    assert read_drafter(src, 30).config.norm_before_residual is True  # vLLM's update_eagle3 default


def test_speculators_trainer_checkpoint_with_matched_settings_converts(checkpoint, tmp_path):
    # speculators 0.9.0 writes rope_theta only under rope_parameters: a reader that missed it would fall
    # back to 10000 and shift every RoPE angle of a SmolLM2-style (rope_theta 100000) drafter
    drafter, ckpt = checkpoint
    cfg = replace(CFG, rope_theta=100000.0)
    src = write_speculators_trained(state_of(ckpt), cfg, tmp_path / "save" / "0")
    back = convert(src, tmp_path / "back", "draftsmith", target_layers=30, drop_embeddings=True).out
    read = json.loads((back / "config.json").read_text())["draftsmith"]
    assert read["drafter"] == {**CFG.to_dict(), "rope_theta": 100000.0} and read["aux_layer_ids_boundary"] == [2, 15, 27]
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_of(ckpt).items()}
    assert_same_tensors(state_of(back), want)


def test_speculators_default_recipe_converts_with_its_input_norm_and_normed_output(checkpoint, tmp_path):
    _, ckpt = checkpoint
    state = state_of(ckpt)
    src = write_speculators_trained(state, CFG, tmp_path / "save" / "0", defaults=True)
    config = json.loads((src / "config.json").read_text())  # as trained with --full-attention-indices 0
    config["transformer_layer_config"].update(layer_types=["full_attention"], use_sliding_window=False)
    (src / "config.json").write_text(json.dumps(config))
    source = read_drafter(src, 30, drop_embeddings=True)
    assert (source.config.norm_before_fc, source.config.norm_output) == (True, True)
    assert source.tensors["input_norm.weight"].shape == (3 * CFG.target_hidden_size,)
    out = convert(src, tmp_path / "vllm", "vllm", target_layers=30, drop_embeddings=True).out
    served = json.loads((out / "config.json").read_text())
    assert served["norm_before_fc"] and served["eagle_config"]["norm_before_fc"] and served["norm_output"]
    assert "input_norm.weight" in load_file(str(out / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="does not compute") as err:  # SGLang would drop both silently
        convert(src, tmp_path / "sglang", "sglang", target_layers=30, drop_embeddings=True)
    assert "norm_before_fc true, norm_output true" in err.value.got and not (tmp_path / "sglang").exists()


def test_an_input_norm_tensor_without_its_flag_is_refused(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["specforge"](state_of(ckpt), CFG, tmp_path / "s")
    save_file({**load_file(str(src / "model.safetensors")), "input_norm.weight": torch.ones(120)},
              str(src / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="do not match") as err:
        read_drafter(src, 30)
    assert "input_norm.weight" in err.value.got


def test_speculators_sliding_window_shorter_than_the_context_is_refused(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = write_speculators_trained(state_of(ckpt), replace(CFG, max_position_embeddings=8192), tmp_path / "s")
    cfg = json.loads((src / "config.json").read_text())
    cfg["transformer_layer_config"].update(layer_types=["sliding_attention"], use_sliding_window=True)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="cannot be converted faithfully") as err:
        read_drafter(src, 30, drop_embeddings=True)
    assert "sliding_window 2048 < context 8192" in err.value.got and "--full-attention-indices" in err.value.got


def test_eagle_release_max_positions_raised_to_the_target_context(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["eagle"](state_of(ckpt), replace(CFG, max_position_embeddings=2048), tmp_path / "e")
    source = read_drafter(src, 30, target_max_positions=8192)
    assert source.config.max_position_embeddings == 8192 and any("raised" in n for n in source.notes)


def test_cli_converts_and_refuses_with_exit_2(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    src = WRITERS["modelopt"](state_of(ckpt), CFG, tmp_path / "m")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "vllm", "--target-layers", "30"]) == 0
    assert "modelopt -> vllm" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert main(["convert", str(src), str(tmp_path / "o2"), "--to", "vllm"]) == 2  # no target depth
    assert "--target-layers" in capsys.readouterr().err


# --- refusals ---------------------------------------------------------------------------------------

def test_mla_drafter_is_refused_with_the_reason(tmp_path):
    with pytest.raises(DraftsmithError, match="MLA drafter cannot be converted") as err:
        convert(write_mla(tmp_path / "mla"), tmp_path / "out", "vllm", target_layers=30)
    assert "kv_a_proj_with_mqa" in err.value.got or "Eagle3DeepseekV2ForCausalLM" in err.value.got
    assert not (tmp_path / "out").exists()


def test_unknown_tensors_are_listed_not_dropped(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["specforge"](state_of(ckpt), CFG, tmp_path / "s")
    extra = {**load_file(str(src / "model.safetensors")), "fc_norm.0.weight": torch.ones(40),
             "midlayers.1.mlp.up_proj.weight": torch.ones(64, 32)}
    save_file(extra, str(src / "model.safetensors"))
    with pytest.raises(DraftsmithError) as err:
        convert(src, tmp_path / "out", "draftsmith", target_layers=30)
    assert "fc_norm.0.weight" in err.value.got and "midlayers.1.mlp.up_proj.weight" in err.value.got


def test_embed_tokens_copy_needs_an_explicit_drop(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["speculators"](state_of(ckpt), CFG, tmp_path / "s")
    save_file({**load_file(str(src / "model.safetensors")), "embed_tokens.weight": torch.ones(96, 32)},
              str(src / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="no place"):
        read_drafter(src, 30)
    source = read_drafter(src, 30, drop_embeddings=True)
    assert "embed_tokens.weight" not in source.tensors and any("dropped embed_tokens" in n for n in source.notes)


@pytest.mark.parametrize("field,value,reason", [
    ("fc_norm", True, "fc_norm"), ("num_hidden_layers", 2, "num_hidden_layers"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling"), ("attention_bias", True, "attention_bias")])
def test_settings_the_drafter_lacks_are_refused(checkpoint, tmp_path, field, value, reason):
    _, ckpt = checkpoint
    src = WRITERS["specforge"](state_of(ckpt), CFG, tmp_path / "s")
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="cannot be converted faithfully") as err:
        read_drafter(src, 30)
    assert reason in err.value.got


def test_modelopt_switches_the_drafter_lacks_are_refused(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["modelopt"](state_of(ckpt), CFG, tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["eagle_config"]["use_last_layernorm"] = False
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="use_last_layernorm"):
        read_drafter(src, 30)


def test_inconsistent_vocab_maps_and_wrong_target_are_refused(checkpoint, tmp_path, tiny_target):
    _, ckpt = checkpoint
    src = WRITERS["eagle"](state_of(ckpt), CFG, tmp_path / "e", dtype="float32")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    state["t2d"] = torch.roll(state["t2d"], 1)
    torch.save(state, src / "pytorch_model.bin")
    with pytest.raises(DraftsmithError, match="d2t and t2d disagree"):
        read_drafter(src, 30)
    src = WRITERS["specforge"](state_of(ckpt), CFG, tmp_path / "s")
    with pytest.raises(DraftsmithError, match="not trained for this target"):  # tiny target: hidden 64, not 40
        convert(src, tmp_path / "out", "draftsmith", target=str(tiny_target), target_layers=30)


def test_aux_ids_outside_the_target_are_refused(checkpoint, tmp_path):
    _, ckpt = checkpoint
    src = WRITERS["specforge"](state_of(ckpt), CFG, tmp_path / "s")
    with pytest.raises(DraftsmithError, match="out of range"):
        read_drafter(src, 20)  # layer-output id 26 -> boundary 27, past a 20-layer target
