"""Writers of the public EAGLE-3 drafter layouts, for test fixtures: real key names and config fields.

Each takes draftsmith-named tensors and a `DrafterConfig` and writes the layout as its public producer
does, written here by hand from the producers' sources (not through draftsmith's exporter), so a
converter bug cannot cancel itself out:

- `write_eagle_release`: SafeAILab/EAGLE @cb7e084 `eagle/traineagle3/config.json` fields and a
  DeepSpeed `pytorch_model.bin` with `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, no ids: EAGLE
  captures the inputs of layers (2, N//2, N-3) (`eagle/model/modeling_llama_kv.py`, the
  `idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2` capture) (docs/training.md §7.5).
- `write_specforge`: `LlamaForCausalLMEagle3` + `eagle_config`, `midlayer.*` keys, ids in the
  layer-output convention SGLang reads (+1) (docs/training.md §7.3, §7.8; docs/engines.md §3.2).
- `write_modelopt`: NVIDIA/Model-Optimizer `modelopt/torch/export/plugins/hf_spec_export.py`
  (`llama_eagle_template_config`, `LLAMA_EAGLE_SINGLE_LAYER`): `layers.0.*`, `fc`, `norm`, `lm_head`,
  `d2t`, no `t2d`, no `target_hidden_size`; ids from a hook on decoder-layer outputs (default
  `[1, N//2-1, N-4]`, `modelopt/torch/speculative/plugins/transformers.py`).
- `write_speculators`: vllm-project/speculators `Eagle3Speculator` as in `nm-testing/EAGLE3-LLaMA3.1-
  Instruct-8B-converted` (docs/training.md §7.2): `speculators_config`, `transformer_layer_config`,
  `target_hidden_size: null` as RedHatAI releases write it, `layers.0.*` keys, boundary ids.
- `write_speculators_trained`: what speculators 0.9.0's trainer saves in `SAVE_PATH/<epoch>/`
  (`train/checkpointer.py` `save_pretrained`; fields as a real `speculators train --dry-run` wrote
  them): `Eagle3DraftModel`, `rope_parameters` without a top-level `rope_theta`, `layer_types` /
  `sliding_window`, `norm_before_fc` / `norm_output` (both true by default for eagle3, with an
  `input_norm.weight`), the verifier's `embed_tokens.weight` copy, `d2t` / `t2d` when the vocab is pruned.
- `write_mla`: ModelOpt's Kimi-K2 MLA drafter (`kimik2_eagle_template_config`, `KIMIK2_EAGLE_SINGLE_LAYER`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.model.eagle3 import DrafterConfig


def llama_fields(cfg: DrafterConfig, dtype: str) -> dict:
    return {"hidden_act": "silu", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings, "model_type": "llama",
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": None,
            "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "torch_dtype": dtype,
            "vocab_size": cfg.vocab_size, "bos_token_id": 1, "eos_token_id": 2, "use_cache": True,
            "transformers_version": "4.51.0", "pretraining_tp": 1, "initializer_range": 0.02}


def layer_output_ids(cfg: DrafterConfig) -> list[int]:
    return [b - 1 for b in cfg.aux_layer_ids]


def renamed(state: dict[str, torch.Tensor], prefix: str, dtype: str, drop: tuple[str, ...] = ()) -> dict:
    cast = getattr(torch, dtype)
    return {(prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k):
            (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in state.items() if k not in drop}


def write_config(path: Path, config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_eagle_release(state: dict, cfg: DrafterConfig, path: Path, dtype: str = "float16") -> Path:
    config = {"architectures": ["LlamaForCausalLM"], **llama_fields(cfg, dtype),
              "draft_vocab_size": cfg.draft_vocab_size}
    write_config(path, config)
    torch.save(renamed(state, "midlayer.", dtype), path / "pytorch_model.bin")
    return path


def write_specforge(state: dict, cfg: DrafterConfig, path: Path, dtype: str = "bfloat16") -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg, dtype),
              "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_output_ids(cfg), "use_aux_hidden_state": True}}
    write_config(path, config)
    save_file(renamed(state, "midlayer.", dtype), str(path / "model.safetensors"))
    return path


def write_modelopt(state: dict, cfg: DrafterConfig, path: Path, dtype: str = "bfloat16") -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg, dtype), "pad_token_id": None,
              "draft_vocab_size": cfg.draft_vocab_size, "attention_bias": False, "attention_dropout": 0.0,
              "mlp_bias": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_output_ids(cfg), "use_aux_hidden_state": True,
                               "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                               "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                               "parallel_draft_heads_num_layers": None}}
    write_config(path, config)
    save_file(renamed(state, "layers.0.", dtype, drop=("t2d",)), str(path / "model.safetensors"))
    return path


def write_speculators(state: dict, cfg: DrafterConfig, path: Path, dtype: str = "bfloat16",
                      verifier: str = "meta-llama/Llama-3.1-8B-Instruct", k: int = 3) -> Path:
    layer = {"architectures": ["LlamaForCausalLM"], **llama_fields(cfg, dtype)}
    config = {"architectures": ["Eagle3Speculator"],
              "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"}, "draft_vocab_size": cfg.draft_vocab_size,
              "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "embed_requires_grad": False,
              "norm_before_fc": False, "norm_before_residual": cfg.norm_before_residual,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                                           "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier}},
              "speculators_model_type": "eagle3", "speculators_version": "0.2.0", "target_hidden_size": None,
              "torch_dtype": dtype, "transformer_layer_config": layer, "transformers_version": "4.51.0"}
    write_config(path, config)
    save_file(renamed(state, "layers.0.", dtype), str(path / "model.safetensors"))
    return path


def write_speculators_trained(state: dict, cfg: DrafterConfig, path: Path, defaults: bool = False,
                              verifier: str = "/models/target") -> Path:
    """`defaults`: speculators' eagle3 defaults (input norm, norm_output, sliding window 2048); else the
    settings matched to draftsmith's (`--no-norm-before-fc --no-norm-output --full-attention-indices 0`)."""
    layer = {k: v for k, v in llama_fields(cfg, "bfloat16").items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    layer.update(rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"}, sliding_window=2048,
                 layer_types=["sliding_attention" if defaults else "full_attention"], use_sliding_window=defaults,
                 attention_bias=False, mlp_bias=False, pad_token_id=None, transformers_version="5.24.0")
    config = {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
              "draft_vocab_size": cfg.draft_vocab_size, "dtype": "bfloat16",
              "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "embed_requires_grad": False,
              "fc_norm": False, "norm_before_fc": defaults, "norm_before_residual": cfg.norm_before_residual,
              "norm_output": defaults,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                           "speculative_tokens": 3, "verifier_accept_k": 1}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier}},
              "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
              "tie_word_embeddings": False, "transformer_layer_config": layer, "transformers_version": "5.24.0"}
    write_config(path, config)
    tensors = renamed(state, "layers.0.", "bfloat16")
    tensors["embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
    if defaults:
        tensors["input_norm.weight"] = torch.ones(3 * cfg.target_hidden_size, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_mla(path: Path, hidden: int = 32) -> Path:
    config = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": hidden,
              "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
              "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 96,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}}
    write_config(path, config)
    g = torch.Generator().manual_seed(0)
    shapes = {"layers.0.self_attn.q_a_proj.weight": (16, 2 * hidden), "layers.0.self_attn.q_a_layernorm.weight": (16,),
              "layers.0.self_attn.q_b_proj.weight": (48, 16), "layers.0.self_attn.kv_a_proj_with_mqa.weight": (12, 2 * hidden),
              "layers.0.self_attn.kv_a_layernorm.weight": (8,), "layers.0.self_attn.kv_b_proj.weight": (64, 8),
              "layers.0.self_attn.o_proj.weight": (hidden, 32), "fc.weight": (hidden, 3 * 40), "norm.weight": (hidden,)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(path / "model.safetensors"))
    return path


WRITERS = {"eagle": write_eagle_release, "specforge": write_specforge, "modelopt": write_modelopt,
           "speculators": write_speculators}
