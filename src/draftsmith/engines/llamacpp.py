"""llama.cpp: EAGLE-3 drafters as GGUF for `llama-server --spec-type draft-eagle3`, and the server itself.

The GGUF is written by llama.cpp's own converter (`convert_hf_to_gguf.py`, vendored in the PyPI sdist of
`llama-cpp-python`, unpacked and built by `make llama-server`) from our vLLM-layout export, so what
llama.cpp loads is exactly what its own tooling produces. Facts this module relies on, all read in
llama-cpp-python 0.3.36 (vendor/llama.cpp):

- The converter detects EAGLE-3 by `draft_vocab_size` with one layer (conversion/llama.py:49-53) and
  writes `eagle3.target_layers` from the *top-level* `eagle_aux_hidden_state_layer_ids` only; without
  it, it writes its default [2, L//2, L-3] (conversion/llama.py:74-82). Our vLLM export keeps the ids in
  `eagle_config`, so the llamacpp export also writes them on top.
- llama.cpp reads id k as the *input* of target layer k (`t_layer_inp[il] = inpL`, src/models/llama.cpp:127;
  common/speculative.cpp:541-548; id == n_layer is the last layer's output), i.e. our boundary
  index, and needs exactly three ids (src/models/eagle3.cpp:6-11).
- `d2t` is stored as absolute target ids (I64), `t2d` is dropped (conversion/llama.py:233-255, 329-350).
- Responses carry `timings.draft_n` / `timings.draft_n_accepted`; `--metrics` exposes
  `llamacpp:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total` and
  `..._num_accepted_tokens_per_pos_total{position}` (tools/server/server-task.cpp:1553-1614).

The export itself (`--format llamacpp`) is `export.export_llamacpp`, which calls the pieces here.

Run: `draftsmith export runs/demo/train/drafter out-llamacpp --format llamacpp --dtype float32`, then the
`llama-server` command printed in `out-llamacpp/README.md`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.conventions import aux_ids_for_format, engine_reads, find_aux_ids
from draftsmith.target import cache_dir

LLAMACPP_SPEC = "llama-cpp-python==0.3.36"  # the sdist `make llama-server` builds (Makefile LLAMACPP_SPEC)
DIR_ENV = "DRAFTSMITH_LLAMACPP_DIR"
OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
EAGLE3_ARCH = "eagle3"  # gguf-py MODEL_ARCH_NAMES[MODEL_ARCH.EAGLE3]
NUM_AUX = 3  # src/models/eagle3.cpp:9 "EAGLE3 requires exactly 3 entries in 'extract_layers'"
MANIFEST = "llamacpp.json"
# The drafter-probability cut-off draftsmith serves with. llama.cpp stops a draft chain at the first token whose
# probability (softmax over the drafter's 10 best logits) is below it (common/speculative.cpp:812). On this 2-core
# CPU a target forward over 2+ tokens costs 1.2-2.6 one-token steps, so drafting only what the drafter is sure of
# pays: SmolLM2 with the shipped drafter, chat-eval, A/B against 0 (benchmarks/results/llamacpp_p_min_ab*.json,
# docs/eval.md "In llama.cpp"): f32 1.02x -> 1.11x at k=3, 0.96x -> 1.14x at k=4; q8_0 0.67x -> 0.80x at k=3.
# Measuring tau at a fixed k (parity with `draftsmith eval`) needs 0.
SERVE_P_MIN = 0.5


# ---------------------------------------------------------------- where llama.cpp lives

def install_dir() -> Path:
    """$DRAFTSMITH_LLAMACPP_DIR, else `<cache>/llama.cpp/llama-cpp-python-<version>` (made by the Makefile)."""
    override = os.environ.get(DIR_ENV)
    return Path(override) if override else cache_dir() / "llama.cpp" / LLAMACPP_SPEC.replace("==", "-")


def _built(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DraftsmithError(f"llama.cpp's {what} is missing", got=str(path),
                              expected=f"the {LLAMACPP_SPEC} sdist unpacked and built under {install_dir()}",
                              fix=f"run `make llama-server` (or set {DIR_ENV})")
    return path


def converter_path() -> Path:
    return _built(install_dir() / "src" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py", "converter")


def server_binary() -> Path:
    return _built(install_dir() / "build" / "bin" / "llama-server", "llama-server")


# ---------------------------------------------------------------- conversion

def convert(model_dir: Path, out_file: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """Run `convert_hf_to_gguf.py` (with its vendored gguf-py) in this interpreter; atomic on success."""
    out_file = Path(out_file)
    tmp = out_file.with_name(out_file.name + ".tmp")
    cmd = [sys.executable, str(converter_path()), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-8:])
        raise DraftsmithError("llama.cpp's converter failed", got=f"exit {res.returncode}: {tail}",
                              expected=f"a GGUF at {out_file}",
                              fix="a missing Python module: `pip install -e '.[llamacpp]'`; otherwise read the lines above")
    tmp.replace(out_file)
    return out_file


@dataclass(frozen=True)
class GgufDrafter:
    """What llama.cpp will read from a drafter GGUF (header metadata only, no weight data)."""

    arch: str
    target_layers: tuple[int, ...] | None
    target_hidden_size: int | None
    norm_before_residual: bool | None
    norm_before_fc: bool | None
    """With it, llama.cpp norms the fused aux states before fc (tensor `enc.output_norm.weight`)."""
    draft_vocab_size: int | None
    """Rows of `d2t`, None without d2t (then llama.cpp drafts over the full target vocabulary)."""
    block_size: int | None = None
    """DFlash: tokens per block (`dflash.block_size`; llama.cpp takes 16 when absent, speculative.cpp:980-986)."""
    mask_token_id: int | None = None
    """DFlash: `tokenizer.ggml.mask_token_id`, the token of the block's masked slots."""


def read_gguf(path: Path) -> GgufDrafter:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = str(value("general.architecture"))
    layers = value(f"{arch}.target_layers")
    d2t = next((t for t in reader.tensors if t.name == "d2t"), None)
    return GgufDrafter(arch=arch, target_layers=tuple(int(i) for i in layers) if layers is not None else None,
                       target_hidden_size=value(f"{arch}.target_hidden_size"),
                       norm_before_residual=value(f"{arch}.norm_before_residual"),
                       norm_before_fc=value(f"{arch}.norm_before_fc"),
                       draft_vocab_size=int(d2t.shape[0]) if d2t is not None else None,
                       block_size=value(f"{arch}.block_size"), mask_token_id=value("tokenizer.ggml.mask_token_id"))


def target_gguf(target_dir: Path, outtype: str = "f32") -> Path:
    """The target as GGUF, converted once into `<cache>/llama.cpp/targets/` and reused.

    Keyed by the directory and its config and weight files, so a changed target converts again.
    """
    target_dir = Path(target_dir).resolve()
    stamp = [str(target_dir), (target_dir / "config.json").read_text()]
    for f in sorted(target_dir.glob("*.safetensors")):
        stamp.append(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}")
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:12]
    out = install_dir().parent / "targets" / f"{target_dir.name}-{key}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert(target_dir, out, outtype)


# ---------------------------------------------------------------- export

def llamacpp_config(config: dict[str, Any]) -> dict[str, Any]:
    """The vLLM-layout config with the aux ids where llama.cpp's converter reads them (top level)."""
    boundary = tuple(config["draftsmith"]["aux_layer_ids_boundary"])
    if len(boundary) != NUM_AUX:
        raise DraftsmithError("llama.cpp runs EAGLE-3 drafters on exactly three target layers",
                              got=f"aux ids {list(boundary)}", expected=f"{NUM_AUX} ids",
                              fix="train the drafter on three aux layers")
    ids = aux_ids_for_format(boundary, "llamacpp")
    return {**config, "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {**config["eagle_config"], "eagle_aux_hidden_state_layer_ids": ids},
            "draftsmith": {**config["draftsmith"], "aux_id_convention": "llamacpp"}}


def draft_args(drafter: str | Path, k: int, p_min: float = SERVE_P_MIN, method: str = "eagle3") -> list[str]:
    """A drafter of `method` (eagle3 | dflash: `--spec-type draft-<method>`) with up to k draft tokens, no minimum
    (common/arg.cpp:4140-4200). p_min 0 drafts all k; above 0 the chain stops at the first draft token whose drafter
    probability is below it (common/speculative.cpp: the greedy top candidate's p; DFlash reads its block the same
    way, :1295-1312), which spares the target verifying tokens it would likely reject (SERVE_P_MIN). DFlash clamps k
    to its GGUF's block_size - 1."""
    return ["-md", str(drafter), "--spec-type", f"draft-{method}", "--spec-draft-n-max", str(k),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{p_min:g}"]


def serve_command(target: str | Path, drafter: str | Path, k: int) -> list[str]:
    return ["llama-server", "-m", str(target), *draft_args(drafter, k), "--metrics"]


def model_card(out: Path, drafter_gguf: str, target: str, ids: list[int], k: int, converted: bool) -> str:
    cmd = " ".join(serve_command(target, out / drafter_gguf, k))
    origin = "converted from the target directory by draftsmith" if converted else "given by you"
    return f"""# EAGLE-3 drafter for llama.cpp (GGUF)

- `{drafter_gguf}`: written by llama.cpp's `convert_hf_to_gguf.py` ({LLAMACPP_SPEC} sdist) from the
  vLLM-layout files next to it (`config.json`, `model.safetensors`).
- Aux layers: `eagle3.target_layers = {ids}`; llama.cpp reads id k as the input of target layer k, the
  boundary indices the drafter was trained on.
- Target GGUF ({origin}): `{target}`

## Serve

```
{cmd} --host 127.0.0.1 --port 8080
```

`--spec-draft-p-min {SERVE_P_MIN:g}` ends a draft at a token the drafter is less sure of (faster on CPUs, where
verifying several tokens costs more than one step; draftsmith's docs/eval.md, "In llama.cpp"); with
`--spec-draft-p-min 0` every draft is k tokens long, as `draftsmith eval` measures tau.

Responses carry `timings.draft_n` and `timings.draft_n_accepted`; `/metrics` carries
`llamacpp:spec_decode_*`, which `draftsmith bench --endpoint http://127.0.0.1:8080` reads.
Check first: `draftsmith check --target TARGET_DIR --drafter {out} --engine llamacpp`.
"""


# ---------------------------------------------------------------- check facts

def llamacpp_facts(drafter_dir: Path, target_num_layers: int) -> dict[str, Any]:
    """The aux ids llama.cpp will read: from a drafter GGUF in the directory, else what the converter
    would write from this config.json (top-level ids only, else its default)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    ggufs = sorted(Path(drafter_dir).glob("*.gguf"))
    meta = read_gguf(ggufs[0]) if ggufs else None
    top, _ = find_aux_ids(config, ("top-level",))
    nested, _ = find_aux_ids(config, ("eagle_config",))
    if meta is not None and meta.target_layers is not None:
        reads, source = list(meta.target_layers), f"GGUF {ggufs[0].name}"  # boundary indices, as written
    else:
        reads = list(engine_reads(config, target_num_layers, "llamacpp"))
        source = ("config.json top-level ids (the converter writes them)" if top
                  else "the converter's default [2, L//2, L-3]")
    return {"llamacpp_aux_reads": reads, "llamacpp_aux_source": source, "llamacpp_aux_count": len(reads),
            "llamacpp_gguf": str(ggufs[0]) if ggufs else None, "llamacpp_gguf_arch": meta.arch if meta else None,
            "llamacpp_nested_ids_ignored": bool(nested) and not top and meta is None and list(nested) != reads,
            "llamacpp_eagle_config_ids": list(nested) if nested else None}


# ---------------------------------------------------------------- serving

@dataclass(frozen=True)
class LlamaServe:
    """Everything that defines one `llama-server` start (greedy; an EAGLE-3 or DFlash drafter)."""

    target: Path
    drafter: Path | None = None
    k: int = 3
    p_min: float = SERVE_P_MIN
    """Drafter-probability cut-off of a draft chain (SERVE_P_MIN; 0: always k tokens, for tau at a fixed k)."""
    port: int = 0
    ctx_size: int = 2048
    threads: int = 2
    parallel: int = 1
    extra_args: tuple[str, ...] = ()
    """Further llama-server flags, last (benchmarks: `-lv 4` logs the drafter's own timings per request)."""
    binary: Path | None = None
    """The llama-server to run; None: the one `make llama-server` built (`server_binary`). Benchmarks set it to
    compare builds of one source (say, other ggml CPU flags) side by side."""
    method: str = "eagle3"
    """The drafter's family as llama.cpp's --spec-type names it (draft-eagle3 | draft-dflash)."""

    def command(self, binary: Path) -> list[str]:
        cmd = [str(binary), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(self.port),
               "--ctx-size", str(self.ctx_size), "--threads", str(self.threads), "--parallel", str(self.parallel),
               "--metrics", "--no-webui"]
        if self.drafter is not None:
            cmd += draft_args(self.drafter, self.k, self.p_min, self.method)
        return cmd + list(self.extra_args)


@contextlib.contextmanager
def serve(spec: LlamaServe, log: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """Start `llama-server` for `spec`, yield its base URL once `/health` answers, stop it on exit."""
    from draftsmith.engines.process import free_port, serve_process

    if spec.port == 0:
        spec = dataclasses.replace(spec, port=free_port())
    with serve_process(spec.command(spec.binary or server_binary()), spec.port, log, timeout_s) as base:
        yield base


@dataclass(frozen=True)
class ServerTimings:
    """One response's `timings` (tools/server/server-common.cpp `server_slot_stats::to_json`).

    `prompt_ms` runs from the slot's start to the last prompt batch; `predicted_ms` from there to the last
    generated token, so it holds every generation step but not the prompt (server-common.h `t_gen_us`)."""

    cache_n: int
    """Prompt tokens reused from the slot's cache (cache_prompt)."""
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0

    @property
    def target_steps(self) -> int:
        """Target forwards during generation: the first token comes from the prompt's logits
        (server-common.h `n_gen_steps`), and each later forward yields one token plus its accepted drafts."""
        return self.predicted_n - 1 - self.draft_n_accepted


def parse_timings(response: dict[str, Any]) -> ServerTimings:
    """The `timings` of a `/completion` response; draft fields are absent when nothing was drafted."""
    t = response.get("timings") or {}
    missing = [f for f in ("cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms") if f not in t]
    if missing:
        raise DraftsmithError("llama-server's response lacks timings", got=f"timings keys {sorted(t)}",
                              expected=f"also {missing}", fix=f"serve with the llama-server of {LLAMACPP_SPEC}")
    return ServerTimings(cache_n=int(t["cache_n"]), prompt_n=int(t["prompt_n"]), prompt_ms=float(t["prompt_ms"]),
                   predicted_n=int(t["predicted_n"]), predicted_ms=float(t["predicted_ms"]),
                   draft_n=int(t.get("draft_n", 0)), draft_n_accepted=int(t.get("draft_n_accepted", 0)))


@dataclass(frozen=True)
class Completion:
    """One greedy `/completion` answer: the token ids and llama.cpp's own timings and draft statistics."""

    tokens: list[int]
    timings: ServerTimings


def complete(base: str, prompt_ids: list[int], max_tokens: int, timeout_s: float = 300.0,
             cache_prompt: bool = False, ignore_eos: bool = False) -> Completion:
    """Greedy completion of token ids (no tokenizer round trip).

    Args:
        cache_prompt: reuse the slot's cached prefix (then `timings.prompt_n` counts only the new tokens).
        ignore_eos: generate exactly `max_tokens` tokens.
    """
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0.0, "return_tokens": True,
            "cache_prompt": cache_prompt, "ignore_eos": ignore_eos}
    req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        res = json.loads(r.read())
    return Completion(tokens=list(res["tokens"]), timings=parse_timings(res))
