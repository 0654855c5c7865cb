"""Same data, two trainers: speculators' EAGLE-3 next to draftsmith's, on one GPU (docs/peers.md).

Four runs over one feature store, each in its own process (so peak GPU memory is its own):

    speculators-defaults   `speculators train` with its eagle3 defaults (0.9.0 `train/config/schema.py`)
    speculators-matched    speculators with draftsmith's defaults wherever it has the knob (`SETTINGS`)
    draftsmith-defaults    `draftsmith train` with its defaults
    draftsmith-matched     draftsmith with speculators' defaults wherever it has the knob

All four see the same samples for the same number of epochs (`--epochs`, default 1: speculators' own
default of 20 does not fit a 10-minute call; the tokens seen are recorded). The store is written in
speculators' offline layout first (`draftsmith export-store`), speculators is called through the same
function its CLI calls (`speculators/cli/train.py`: `main(TrainConfig.resolve(argv))`), and its last
epoch's checkpoint is converted with `draftsmith convert`; a refusal is recorded with its reason (its
default recipe has an input norm draftsmith's drafter lacks).

Recorded per run (benchmarks/results/speculators_compare.json): wall time of the whole train call
(build, epochs, validation, checkpoint), training tokens (train split x epochs), tokens/s over that wall
time, peak GPU memory (`torch.cuda.max_memory_allocated`), the exact argv, and the convert result.

speculators is imported lazily: it is absent on CPU machines; docs/peers.md lists the wheels to carry.

    python benchmarks/speculators_compare.py --store runs/smollm2/store --target smollm2 --work /tmp/cmp
    python benchmarks/speculators_compare.py --store S --target T --work W --only draftsmith-defaults
    python benchmarks/speculators_compare.py --store S --work W --only draftsmith-defaults+compile \
        --only draftsmith-defaults+lr=1e-3     # variants: a draftsmith run with TrainConfig fields changed

A variant is a draftsmith run's name followed by `+FIELD=VALUE` (or `+compile` for `+compile=true`) per
changed `TrainConfig` field: the ablations of #23's deliverable 4, and `--compile` beside the eager default,
trained over the same store in the same call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftsmith.conventions import NORM_VARIANTS  # noqa: E402
from draftsmith.train.settings import DEFAULT_RECIPE, RECIPES, SCRATCH_LR  # noqa: E402  (the package is light to import: no engine, no GPU)

RUNS = ("speculators-defaults", "speculators-matched", "draftsmith-defaults", "draftsmith-matched")
RESULTS = Path(__file__).resolve().parent / "results" / "speculators_compare.json"
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_MISSING = (f"speculators {SPECULATORS_VERSION} is not importable here: carry its wheels and those of "
                       "its missing dependencies (docs/peers.md, 'Running it on the H200'), or run with "
                       "--only draftsmith-defaults --only draftsmith-matched")


def run_variant(name: str) -> tuple[str, dict[str, Any]]:
    """(base run, TrainConfig overrides) of a run name: `draftsmith-defaults+compile+lr=1e-3` is
    ("draftsmith-defaults", {"compile": "true", "lr": "1e-3"}); values stay strings for TrainConfig to
    validate. Only draftsmith runs take overrides (speculators' are its own argv)."""
    base, *changes = name.split("+")
    if base not in RUNS:
        raise argparse.ArgumentTypeError(f"run {name!r}: {base!r} is not one of {', '.join(RUNS)}")
    if changes and not base.startswith("draftsmith"):
        raise argparse.ArgumentTypeError(f"run {name!r}: only draftsmith runs take +FIELD=VALUE variants")
    from draftsmith.train.settings import TrainConfig

    overrides: dict[str, Any] = {}
    for change in changes:
        key, _, value = change.partition("=")
        if key not in TrainConfig.model_fields:
            raise argparse.ArgumentTypeError(f"run {name!r}: {key!r} is not a TrainConfig field")
        overrides[key] = value or "true"
    return base, overrides


@dataclass(frozen=True)
class Setting:
    """One training setting as each trainer names it, with each one's default.

    `draftsmith` is a `TrainConfig` field, or a fixed trait of its recipe in parentheses; `speculators` is
    a `speculators train` flag, or a fixed trait in parentheses. A fixed side cannot be set, so that
    setting is matched in one direction only (or not at all).
    """

    draftsmith: str
    speculators: str
    draftsmith_default: Any
    speculators_default: Any
    note: str = ""

    @property
    def fixed(self) -> tuple[bool, bool]:
        return self.draftsmith.startswith("("), self.speculators.startswith("(")


# Defaults: draftsmith's from `draftsmith.train.settings.TrainConfig` / `DrafterConfig`; speculators 0.9.0's from
# `speculators/train/config/schema.py` (`_resolve_derived_defaults` for the eagle3-specific ones) and
# `speculators/train/trainer.py` (the hard-coded clip).
SETTINGS = (
    Setting("ttt_steps", "--ttt-steps", 7, 3),
    Setting("step_loss_decay", "--ttt-step-loss-decay", 0.8, 1.0),
    Setting("lr", "--lr", None, 1e-3, "draftsmith's null: 1e-3 for a new drafter, 2e-4 with --init-from"),
    Setting("weight_decay", "--weight-decay", 0.0, 0.01),
    Setting("batch_tokens", "--total-seq-len", 4096, 8192, "tokens per packed row and optimizer step"),
    Setting("eval_fraction", "--train-data-ratio", 0.05, 0.9, "speculators' value is 1 - draftsmith's"),
    Setting("warmup_ratio", "--scheduler-warmup-ratio", 0.015, None, "speculators: None = 1% of the steps"),
    Setting("seed", "--seed", 0, 42),
    Setting("epochs", "--epochs", 1.0, 20, "the benchmark sets every run to --epochs"),
    Setting("draft_vocab_size", "--draft-vocab-size", "vocab // 6, 64-aligned (32000 from vocab 64000)", "full vocab",
            "the benchmark sets each matched run to the other trainer's choice"),
    Setting("clip", "(clip_grad_norm_ 1.0, fixed)", 0.5, 1.0, "speculators cannot be set: matched one way"),
    Setting("(AdamW)", "--optimizer", "adamw", "muon"),
    Setting("(cosine to lr x min_lr_ratio 0.1)", "--scheduler-type", "cosine", "linear",
            "speculators' cosine decays to 0: the floor is not matched"),
    Setting("norm_before_fc", "--norm-before-fc", None, True, "an RMSNorm over the 3 concatenated aux states; "
            "draftsmith's null: its recipe's (normed: true; plain: false)"),
    Setting("norm_output", "--norm-output", None, True, "the state carried across TTT steps: normed; null as above"),
    Setting("norm_before_residual", "--norm-before-residual", None, True, "the residual: the normed state; null as above"),
    Setting("(full attention)", "--full-attention-indices", [0], [], "[]: sliding window 2048 in every layer"),
    Setting("(soft cross-entropy to the target)", "--loss-fn", "kl_div", "kl_div", "the same gradient"),
)
PER_RUN = ("epochs", "draft_vocab_size")  # set by the benchmark for every run, not by the mapping
# Value maps, the same both ways: train ratio = 1 - eval fraction; speculators' unset warm-up is 1 % of steps;
# draftsmith's unset lr is SCRATCH_LR for a new drafter (every run here starts one), an unset norm its recipe's.


def recipe_value(field: str) -> Callable[[Any], Any]:
    """CONVERT's map of a norm field: null is the default recipe's value."""
    return lambda x: getattr(RECIPES[DEFAULT_RECIPE], field) if x is None else x


CONVERT = {"eval_fraction": lambda x: round(1 - x, 6), "warmup_ratio": lambda x: 0.01 if x is None else x,
           "lr": lambda x: SCRATCH_LR if x is None else x, **{f: recipe_value(f) for f in NORM_VARIANTS}}


def settings_table() -> str:
    """SETTINGS as the markdown table docs/peers.md shows (a test keeps the two equal)."""
    def cell(v: Any) -> str:  # a name or value in code type; a description or fixed trait as text
        text = v if isinstance(v, str) else json.dumps(v)
        return text if " " in text or text.startswith("(") else f"`{text}`"

    rows = ["| draftsmith | speculators 0.9.0 | draftsmith default | speculators default | note |",
            "|---|---|---|---|---|"]
    rows += [f"| {cell(s.draftsmith)} | {cell(s.speculators)} | {cell(s.draftsmith_default)} | "
             f"{cell(s.speculators_default)} | {s.note} |" for s in SETTINGS]
    return "\n".join(rows)


def speculators_matched_args() -> list[str]:
    """`speculators train` flags that set speculators to draftsmith's defaults (speculators-matched)."""
    argv: list[str] = []
    for s in SETTINGS:
        if s.fixed[1] or s.draftsmith in PER_RUN:
            continue
        value = CONVERT.get(s.draftsmith, lambda x: x)(s.draftsmith_default)
        if isinstance(value, bool):  # BooleanOptionalAction: --x / --no-x (resolution.py)
            argv.append(("--" if value else "--no-") + s.speculators[2:])
        elif isinstance(value, list):  # nargs="+"
            argv += [s.speculators, *map(str, value)]
        else:
            argv += [s.speculators, str(value)]
    return argv


def draftsmith_matched_values() -> dict[str, Any]:
    """TrainConfig fields that set draftsmith to speculators' defaults (draftsmith-matched)."""
    return {s.draftsmith: CONVERT.get(s.draftsmith, lambda x: x)(s.speculators_default)
            for s in SETTINGS if not s.fixed[0] and s.draftsmith not in PER_RUN}


SPECULATORS_LOSS = ("--loss-implementation", "eager")
"""Both speculators runs use its eager loss (same KL math, schema.py `LossArgs`: "for compatibility and numerical
validation"): its default fused Triton loss stopped both runs on the H200 (torch 2.11, 2026-12-02) inside
torch.compile, `AssertionError: ListVariable(length=21) is already tracked for mutation` at `losses/fused.py`
`loss_backward_kernel.configs` (`first_try` in benchmarks/results/speculators_compare.json as of commit b6ca207)."""


SPECULATORS_WINDOW = 2048
"""speculators 0.9.0's default sliding window (every layer, `--full-attention-indices` []). Its mask
(models/eagle3/attention.py) is the document mask AND `kv_idx > q_idx - window`, so on a store whose longest
conversation is at most this long the window never binds, and `--full-attention-indices 0` trains the same
numbers; speculators-defaults gets it there, so that the drafter converts (draftsmith's drafter attends fully)
and serves in every engine the same way. On longer data it keeps the window and convert refuses it."""


def speculators_argv(run: str, data: Path, target: Path, save: Path, aux_ids: list[int], epochs: float,
                     draft_vocab: int, max_length: int | None = None) -> list[str]:
    """The exact `speculators train` arguments of a run (aux ids as is: speculators reads boundaries;
    `max_length`, the store's longest sample: SPECULATORS_WINDOW)."""
    from draftsmith.conventions import TRAINER_CONVENTIONS, from_boundary

    ids = from_boundary(tuple(aux_ids), TRAINER_CONVENTIONS["speculators"])
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target), "--data-path", str(data),
            "--save-path", str(save), "--log-dir", str(save.parent / "logs"), "--target-layer-ids", *map(str, ids),
            "--epochs", str(max(1, math.ceil(epochs))), "--on-missing", "raise", *SPECULATORS_LOSS]
    if run == "speculators-matched":
        argv += [*speculators_matched_args(), "--draft-vocab-size", str(draft_vocab)]
    elif max_length is not None and max_length <= SPECULATORS_WINDOW:
        argv += ["--full-attention-indices", "0"]
    return argv


def draftsmith_values(run: str, store: Path, out: Path, epochs: float, vocab: int) -> dict[str, Any]:
    """TrainConfig fields of a draftsmith run (matched: speculators' full vocabulary too; a variant's
    overrides last)."""
    base, overrides = run_variant(run)
    values: dict[str, Any] = {"store": str(store), "out": str(out), "epochs": epochs}
    if base == "draftsmith-matched":
        values.update(draftsmith_matched_values(), draft_vocab_size=vocab)
    return {**values, **overrides}


def requirement_problems(root: str = "speculators") -> list[str]:
    """Every requirement under `root` (its Requires-Dist, recursively, extras left out) that is missing or
    of a version outside its range, as installed here: what to carry before training."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen, problems = [Requirement(root)], set(), []
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} is not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} is installed, {req} is required")
        todo += [r for r in map(Requirement, metadata.requires(name) or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    return sorted(problems)


def latest_epoch_dir(save: Path) -> Path:
    """speculators' `SAVE_PATH/<epoch>/` with the highest epoch number (train/checkpointer.py)."""
    from draftsmith.errors import DraftsmithError

    epochs = sorted((p for p in Path(save).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise DraftsmithError("speculators saved no checkpoint", got=f"no <epoch>/ folder in {save}",
                              expected="SAVE_PATH/0/model.safetensors", fix="read the run's log above")
    return epochs[-1]


def convert_checkpoint(save: Path, out: Path, target: str) -> dict[str, Any]:
    """`draftsmith convert` of speculators' last checkpoint: {"ok": True, "out"} or {"ok": False, "error"}."""
    from draftsmith.export.convert import convert
    from draftsmith.errors import DraftsmithError

    try:
        src = latest_epoch_dir(save)
        result = convert(src, out, "draftsmith", target=target, drop_embeddings=True)
        return {"ok": True, "source": str(src), "out": str(result.out)}
    except DraftsmithError as err:
        return {"ok": False, "error": err.render()}


def train_split_tokens(lengths: list[int], ratio: float) -> int:
    """Tokens speculators trains on per epoch: its train split is the first int(n * ratio) rows
    (train/data.py ArrowDataset), each one token shorter after `shift_batch`."""
    return sum(n - 1 for n in lengths[: int(len(lengths) * ratio)])


# --- one run, in a child process -------------------------------------------------------------------

CPU_SMOKE_ARGV = ("--draft-attn-impl", "sdpa", "--num-workers", "2")
"""Appended to a speculators run's argv on a CPU smoke run only: torch's FlexAttention, speculators' default
attention, has no backward on CPU ("FlexAttention does not support backward on CPU"), and its 12 spawned
data-loader workers take over a minute to start on 2 cores. Neither flag is used or recorded on a GPU."""


def speculators_on_cpu() -> dict:
    """Let speculators 0.9.0 train on a CPU, for a smoke run of the benchmark only (never on a GPU).

    Its single-process `Trainer` puts the model and each batch on `get_local_rank()`, the int 0, which is
    cuda:0 (train/trainer.py `setup_model`, `train_epoch`, `val_epoch`), and its step timer calls
    `torch.accelerator.synchronize()`, which a CUDA build of torch without a GPU refuses; everything before
    the first of these (config, vocab mapping, model build, data loaders) is device-free. Its bf16 autocast
    names device type "cuda" where no accelerator is found, which CPU tensors ignore (then `fc` meets bf16
    hidden states with fp32 weights: `--no-norm-before-fc` fails), so it is pointed at "cpu". On CPU it
    also skips `torch.compile` of the forward (models/utils.py `conditional_torch_compile`), so a smoke run
    checks arguments, data, loss, checkpoint and convert; SPECULATORS_CPU_COMPILE=aot_eager compiles the
    forward as the GPU does (dynamo and AOTAutograd, the stage where the fused loss failed on the H200)
    with a backend that generates no code."""
    import torch

    import speculators.train.trainer as spec_trainer
    from speculators.models.eagle3.core import Eagle3DraftModel

    setup_model = spec_trainer.Trainer.setup_model

    def setup_model_on_cpu(self) -> None:
        self.device_type = "cpu"  # torch.autocast(self.device_type, bf16) in train_epoch and val_epoch
        setup_model(self)

    spec_trainer.get_local_rank = lambda: "cpu"
    spec_trainer.Trainer.setup_model = setup_model_on_cpu
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    if backend := os.environ.get("SPECULATORS_CPU_COMPILE"):
        Eagle3DraftModel.forward = torch.compile(Eagle3DraftModel.forward, backend=backend)
    return {"cpu_smoke": f"speculators' Trainer on 'cpu' (bf16 autocast there), accelerator sync off, forward "
                         f"compiled with {backend or 'nothing'}, extra argv {' '.join(CPU_SMOKE_ARGV)}"}


def run_child(spec: dict) -> dict:
    """Train one run here and measure it; `spec` is what `run_parent` wrote."""
    import torch

    cuda = torch.cuda.is_available()  # the CPU path exists for the tests' smoke run only
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if spec["trainer"] == "speculators":
        from speculators.train.cli import main
        from speculators.train.config import TrainConfig as SpecConfig

        extra = {} if cuda else speculators_on_cpu()
        argv = spec["argv"] if cuda else [*spec["argv"], *CPU_SMOKE_ARGV]
        main(SpecConfig.resolve(argv))  # what `speculators train ARGV` runs (cli/train.py)
    else:
        from draftsmith.train.settings import TrainConfig
        from draftsmith.train.trainer import Trainer

        trainer = Trainer(TrainConfig(**spec["values"]))
        result = trainer.run(progress=False)
        trainer.close()
        extra = {"simulated_tau_k4": result.tau.get(4), "acc": list(result.acc)}
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"wall_s": time.perf_counter() - start, "peak_gpu_mem_gib": peak, **extra}


def draftsmith_tokens(out: Path) -> tuple[int, float]:
    """(training tokens, their summed step time in s) from a draftsmith run's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tok_per_s" in r]
    return sum(r["tokens"] for r in steps), sum(r["ms"] for r in steps) / 1000


SPECULATORS_STEP = re.compile(r"profile/step_ms=([0-9.e+-]+), profile/tokens_per_s=([0-9.e+-]+)")


def step_rates(out: Path, trainer: str) -> dict[str, Any] | None:
    """Per-step rate of a finished run, its first step (compile and warm-up) apart: the median of each step's
    own tokens/s over the later steps, in each trainer's own token count. draftsmith: metrics.jsonl; speculators:
    the `profile/step_ms` and `profile/tokens_per_s` its train log prints for every step. None if neither is there."""
    if trainer == "draftsmith":
        path = out / "train" / "metrics.jsonl"
        if not path.is_file():
            return None
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        steps = [(r["ms"], r["tok_per_s"]) for r in rows if "tok_per_s" in r]
    else:
        log = out / "train.log"
        steps = [(float(ms), float(rate)) for ms, rate in SPECULATORS_STEP.findall(log.read_text(errors="replace"))] \
            if log.is_file() else []
    if len(steps) < 2:
        return None
    return {"steps": len(steps), "first_step_s": round(steps[0][0] / 1000, 1),
            "median_step_ms": round(statistics.median(ms for ms, _ in steps[1:]), 2),
            "median_step_tokens_per_s": round(statistics.median(rate for _, rate in steps[1:]))}


GRACE_S = 20  # SIGTERM to SIGKILL: speculators saves an `interrupted` checkpoint first (train/graceful_shutdown.py)
MIN_RUN_S = 30  # a run is not started with less of --max-seconds left than this
RESERVE_S = 15  # of --max-seconds, kept after the last run for its convert and the JSON
SUMMARY_TAIL = 12  # log lines a failed run shows in the summary: four fit a 12,000-character output tail
PROGRESS_MARKS = ("it/s", "\u2501", "%|")  # tqdm / rich progress-bar lines, left out of a log tail


@dataclass(frozen=True)
class ChildResult:
    returncode: int
    timed_out: bool
    seconds: float


def run_logged(cmd: list[str], log: Path, timeout: float | None) -> ChildResult:
    """Run `cmd` in a process group of its own, stdout and stderr to `log`. Past `timeout` seconds the group
    (data-loader workers included) gets SIGTERM, and SIGKILL GRACE_S later if it is still there."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            return ChildResult(proc.wait(timeout=timeout), False, time.perf_counter() - start)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):  # workers that outlived their parent
                os.killpg(proc.pid, signal.SIGKILL)
            return ChildResult(proc.wait(), True, time.perf_counter() - start)


def log_tail(log: Path, lines: int = 25) -> list[str]:
    """The last `lines` lines of a run's log that are not progress bars, each cut to 300 characters."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    kept = [line.rstrip()[:300] for line in text.splitlines()
            if line.strip() and not any(mark in line for mark in PROGRESS_MARKS)]
    return kept[-lines:]


def run_one(run: str, args, work: Path, data: Path, target_dir: Path, aux_ids: list[int], vocab: int,
            lengths: list[int], timeout: float | None = None) -> dict:
    """Train one run in a child process (stopped after `timeout` s); its record for the results JSON."""
    from draftsmith.model.vocab import default_draft_vocab_size

    trainer = run.split("-")[0]
    out = work / run
    out.mkdir(parents=True, exist_ok=True)
    if trainer == "speculators":
        spec = {"trainer": trainer, "argv": speculators_argv(run, data, target_dir, out / "checkpoints", aux_ids,
                                                             args.epochs, default_draft_vocab_size(vocab),
                                                             max(lengths, default=0))}
    else:
        spec = {"trainer": trainer, "values": draftsmith_values(run, Path(args.store), out / "train", args.epochs,
                                                                vocab)}
    (out / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    (out / "measured.json").unlink(missing_ok=True)
    child = run_logged([sys.executable, __file__, "--child", str(out / "spec.json")], out / "train.log", timeout)
    print(f"--- {run}: {out / 'train.log'}\n{(out / 'train.log').read_text(errors='replace')}", flush=True)
    record: dict[str, Any] = {"run": run, **spec, "returncode": child.returncode, "seconds": round(child.seconds, 1)}
    if child.timed_out:
        record["timed_out"] = f"stopped after {timeout:.0f} s, the time left of --max-seconds {args.max_seconds:g}"
    if child.returncode != 0 or child.timed_out:
        record["log_tail"] = log_tail(out / "train.log")
        if trainer == "draftsmith" and (out / "train" / "metrics.jsonl").is_file():
            record["partial_train_tokens"] = draftsmith_tokens(out / "train")[0]
        # speculators saves an epoch before validating it: a run stopped in validation still has its drafter
        if trainer == "speculators" and any(p.name.isdigit() for p in (out / "checkpoints").glob("*")):
            record["convert"] = convert_checkpoint(out / "checkpoints", out / "converted", str(target_dir))
        return record
    record.update(json.loads((out / "measured.json").read_text()))
    if trainer == "speculators":
        ratio = 0.95 if run == "speculators-matched" else 0.9
        record["train_tokens"] = train_split_tokens(lengths, ratio) * max(1, math.ceil(args.epochs))
        record["convert"] = convert_checkpoint(out / "checkpoints", out / "converted", str(target_dir))
    else:
        record["train_tokens"], step_s = draftsmith_tokens(out / "train")
        record["step_tokens_per_s"] = record["train_tokens"] / step_s if step_s else None
    record["tokens_per_s"] = record["train_tokens"] / record["wall_s"]
    record["step_rate"] = step_rates(out, trainer)
    return record


def run_all(runs: list[str], run: Callable[[str, float | None], dict], write: Callable[[list[dict]], None],
            deadline: float | None, concurrent: bool = False) -> list[dict]:
    """`run(name, seconds left)` for each run while time is left before `deadline` (time.monotonic), a
    skipped record for each after it; `write` gets the records so far after each, so an overrun keeps them.
    `concurrent`: every run starts at once, each with the whole time left (records in the order of `runs`,
    written as each ends)."""
    if concurrent:
        return run_concurrently(runs, run, write, deadline)
    records: list[dict] = []
    for name in runs:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < MIN_RUN_S:
            records.append({"run": name, "skipped": f"{max(0.0, left):.0f} s left of --max-seconds"})
        else:
            records.append(run(name, left))
        write(records)
    return records


def run_concurrently(runs: list[str], run: Callable[[str, float | None], dict],
                     write: Callable[[list[dict]], None], deadline: float | None) -> list[dict]:
    """run_all's concurrent form: one thread per run (each waits on its own child process)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left < MIN_RUN_S:
        return [{"run": name, "skipped": f"{max(0.0, left):.0f} s left of --max-seconds"} for name in runs]
    done: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=len(runs) or 1) as pool:
        futures = {pool.submit(run, name, left): name for name in runs}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            write([done[name] for name in runs if name in done])
    return [done[name] for name in runs]


def write_json(path: Path, result: dict) -> None:
    """The results JSON, written whole to a temporary name and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def run_parent(args, started: float | None = None) -> dict:
    """Export the store, train every run and write args.out after each; `started` (time.monotonic) is
    where --max-seconds counts from."""
    import torch

    from draftsmith.capture.interop import EXPORT_INFO, export_speculators, write_index
    from draftsmith.capture.store import FeatureStore
    from draftsmith.target import resolve_target

    started = time.monotonic() if started is None else started
    runs = args.only or list(RUNS)
    speculators = any(r.startswith("speculators") for r in runs)
    if speculators:
        if importlib.util.find_spec("speculators") is None:
            sys.exit(SPECULATORS_MISSING)
        if problems := requirement_problems():
            sys.exit("speculators' requirements are not met here:\n  " + "\n  ".join(problems)
                     + "\ncarry the wheels docs/peers.md lists (or the versions named above)")
    store = FeatureStore(Path(args.store))
    target_dir = resolve_target(args.target or store.identity["target"]["name"])
    work, data = Path(args.work), Path(args.work) / "speculators-data"
    if speculators and not (data / EXPORT_INFO).is_file():
        export_speculators(Path(args.store), data, str(target_dir), index=False)
    if speculators and not (data / "state.json").is_file():
        if (index := write_index(data)) != "written":
            sys.exit(f"the speculators index of {data} is {index}")
    vocab = store.identity["target"]["vocab_size"]
    lengths = [store.sample_length(k) for k in range(len(store))]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"date": datetime.date.today().isoformat(), "device": device,
              "torch": torch.__version__, "speculators": SPECULATORS_VERSION, "store": str(Path(args.store).resolve()),
              "target": str(target_dir), "epochs": args.epochs, "num_samples": len(store),
              "store_tokens": store.manifest["num_tokens"], "max_seconds": args.max_seconds, "complete": False,
              "runs": [], "settings": [s.__dict__ for s in SETTINGS],
              "note": "wall_s covers the whole train call (model build, epochs, validation, checkpoint) for both "
                      "trainers; step_tokens_per_s (draftsmith only) sums its logged step times, the first "
                      "(compile) included; step_rate: each trainer's median per-step tokens/s, first step apart",
              "concurrent": args.concurrent}
    if args.concurrent:
        result["note"] += ("; concurrent: the runs shared the GPU and CPUs, so their times and rates are not "
                           "throughput figures (acceptance and peak memory per process still are)")

    def one(run: str, left: float | None) -> dict:
        return run_one(run, args, work, data, target_dir, store.identity["aux_layer_ids"], vocab, lengths, left)

    deadline = None if args.max_seconds is None else started + args.max_seconds - RESERVE_S
    result["runs"] = run_all(runs, one, lambda records: write_json(Path(args.out), {**result, "runs": records}),
                             deadline, concurrent=args.concurrent)
    result["complete"] = True
    write_json(Path(args.out), result)
    return result


def summary(result: dict) -> str:
    """One line per run, and the end of the log tail of each that failed or was stopped: what a
    12,000-character tail of the device's output has room for."""
    lines = [f"== summary: {result['device']}, torch {result['torch']}, {result['num_samples']} samples"]
    for r in result["runs"]:
        if "skipped" in r:
            lines.append(f"{r['run']:22s} skipped: {r['skipped']}")
            continue
        peak, convert, rate = r.get("peak_gpu_mem_gib"), r.get("convert"), r.get("step_rate")
        conv = "-" if convert is None else "ok" if convert["ok"] else "refused: " + convert["error"].splitlines()[0]
        lines.append(f"{r['run']:22s} rc {r['returncode']} | {r['seconds']:.0f} s | "
                     f"{r.get('tokens_per_s', float('nan')):,.0f} tok/s | "
                     + (f"step median {rate['median_step_tokens_per_s']:,} tok/s, first {rate['first_step_s']} s | "
                        if rate else "")
                     + f"peak {'-' if peak is None else f'{peak:.1f} GiB'} | convert {conv}"
                     + (f" | {r['timed_out']}" if "timed_out" in r else ""))
        lines += [f"    {line[:200]}" for line in r.get("log_tail", [])[-SUMMARY_TAIL:]]
    return "\n".join(lines)


def checked_run(name: str) -> str:
    """--only's type: a run name, variants checked (run_variant raises what argparse reports)."""
    run_variant(name)
    return name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", help="feature store (draftsmith capture)")
    p.add_argument("--target", default=None, help="target name or directory (default: the store's)")
    p.add_argument("--work", default="/tmp/speculators_compare", help="working directory for the four runs")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs for every run (speculators: rounded up)")
    p.add_argument("--only", action="append", type=checked_run, metavar="RUN",
                   help=f"run only these (repeatable; default all four: {', '.join(RUNS)}); a draftsmith run may "
                        "carry +FIELD=VALUE changes of TrainConfig (+compile for +compile=true)")
    p.add_argument("--out", default=str(RESULTS), help="results JSON")
    p.add_argument("--concurrent", action="store_true",
                   help="start every run at once, each in its own process (ablations: what each drafter accepts "
                        "and its peak memory; the times are then not throughput figures)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-time budget of the whole benchmark: a run still going when it is spent is stopped, "
                        "later runs are skipped, and the JSON keeps what finished (it is rewritten after each run)")
    p.add_argument("--check-env", action="store_true", help="only list speculators' unmet requirements here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    if args.child:
        spec_path = Path(args.child)
        measured = run_child(json.loads(spec_path.read_text()))
        (spec_path.parent / "measured.json").write_text(json.dumps(measured, indent=2) + "\n")
        return 0
    if args.check_env:
        problems = requirement_problems()
        print("\n".join(problems) or f"speculators {SPECULATORS_VERSION} and its requirements: all installed")
        return 1 if problems else 0
    if not args.store:
        build_parser().error("--store is required")
    result = run_parent(args, started)
    print(summary(result))
    return 0 if all(r.get("returncode") == 0 and "timed_out" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
