"""Small random DFlash drafter folders for the SmolLM2 target (hidden 576, 9 heads, 3 kv heads, head_dim 64,
vocab 49152, 30 layers): draftsmith's own layout (vLLM's plus a `draftsmith.drafter` block), and the published
z-lab and speculators layouts, whose config files are kept in tests/fixtures/."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "vocab_size": 49152, "num_hidden_layers": 30, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "max_position_embeddings": 8192}
BOUNDARY = (2, 15, 27)
MASK = 16  # SmolLM2's <empty_output>
BLOCK = 8


def dflash_tensors(layers: int = 1, intermediate: int = 256, n_aux: int = len(BOUNDARY), seed: int = 0,
                   hidden: int = SMOLLM2["hidden_size"]) -> dict[str, torch.Tensor]:
    """Random weights under vLLM's DFlash names (no embed_tokens, no lm_head: the target's are shared)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv, hd = SMOLLM2["num_attention_heads"], SMOLLM2["num_key_value_heads"], SMOLLM2["head_dim"]
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).contiguous()  # noqa: E731
    ones = lambda n: torch.ones(n) + torch.randn(n, generator=g) * 0.01  # noqa: E731
    out = {"fc.weight": rand(hidden, n_aux * SMOLLM2["hidden_size"]), "hidden_norm.weight": ones(hidden),
           "norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + "self_attn.q_proj.weight": rand(heads * hd, hidden), p + "self_attn.k_proj.weight": rand(kv * hd, hidden),
                p + "self_attn.v_proj.weight": rand(kv * hd, hidden), p + "self_attn.o_proj.weight": rand(hidden, heads * hd),
                p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
                p + "mlp.gate_proj.weight": rand(intermediate, hidden), p + "mlp.up_proj.weight": rand(intermediate, hidden),
                p + "mlp.down_proj.weight": rand(hidden, intermediate)}
    return out


def vllm_config(layers: int = 1, intermediate: int = 256, boundary: tuple[int, ...] = BOUNDARY, block: int = BLOCK,
                mask: int = MASK) -> dict:
    """The vLLM / z-lab DFlash config.json for the SmolLM2 target."""
    s = SMOLLM2
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": s["hidden_size"],
            "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
            "head_dim": s["head_dim"], "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"],
            "max_position_embeddings": s["max_position_embeddings"], "vocab_size": s["vocab_size"],
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
            "target_hidden_size": s["hidden_size"], "block_size": block, "num_target_layers": s["num_hidden_layers"],
            "dflash_config": {"mask_token_id": mask, "target_layer_ids": [b - 1 for b in boundary]}}


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_dflash(folder: Path, layers: int = 1, intermediate: int = 256, boundary: tuple[int, ...] = BOUNDARY,
                 block: int = BLOCK, mask: int = MASK, seed: int = 0, **config_changes) -> Path:
    """A draftsmith DFlash drafter folder: the vLLM layout plus the `draftsmith` block `train` writes."""
    config = vllm_config(layers, intermediate, boundary, block, mask) | config_changes
    config["draftsmith"] = {
        "drafter": {"family": "dflash", "hidden_size": config["hidden_size"], "intermediate_size": intermediate,
                    "num_layers": layers, "num_heads": SMOLLM2["num_attention_heads"],
                    "num_kv_heads": SMOLLM2["num_key_value_heads"], "head_dim": SMOLLM2["head_dim"],
                    "vocab_size": SMOLLM2["vocab_size"], "target_hidden_size": SMOLLM2["hidden_size"],
                    "target_num_layers": SMOLLM2["num_hidden_layers"], "aux_layer_ids": list(boundary),
                    "block_size": block, "mask_token_id": mask},
        "aux_layer_ids_boundary": list(boundary), "target": "smollm2", "trained_steps": 5}
    return write_folder(folder, config, dflash_tensors(layers, intermediate, len(boundary), seed))


def fixture_config(name: str) -> dict:
    """A published layout's config.json (tests/fixtures/<name>.json)."""
    return copy.deepcopy(json.loads((FIXTURES / f"{name}.json").read_text()))


def write_published(folder: Path, name: str, seed: int = 0) -> Path:
    """A folder in a published layout (`dflash_zlab_config` or `dflash_speculators_config`) with random weights
    of its config's shapes."""
    config = fixture_config(name)
    layer = config.get("transformer_layer_config") or config
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or config.get("aux_hidden_state_layer_ids")
    tensors = dflash_tensors(layer["num_hidden_layers"], layer["intermediate_size"], len(ids), seed)
    return write_folder(folder, config, tensors)
