"""Same data, two trainers (issue #23): speculators' EAGLE-3 next to draftsmith's, on one GPU.

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
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RUNS = ("speculators-defaults", "speculators-matched", "draftsmith-defaults", "draftsmith-matched")
RESULTS = Path(__file__).resolve().parent / "results" / "speculators_compare.json"
SPECULATORS_VERSION = "0.9.0"
SPECULATORS_MISSING = (f"speculators {SPECULATORS_VERSION} is not importable here: carry its wheels and those of "
                       "its missing dependencies (docs/peers.md, 'Running it on the H200'), or run with "
                       "--only draftsmith-defaults --only draftsmith-matched")


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


# Defaults: draftsmith's from `draftsmith.train.TrainConfig` / `DrafterConfig`; speculators 0.9.0's from
# `speculators/train/config/schema.py` (`_resolve_derived_defaults` for the eagle3-specific ones) and
# `speculators/train/trainer.py` (the hard-coded clip).
SETTINGS = (
    Setting("ttt_steps", "--ttt-steps", 7, 3),
    Setting("step_loss_decay", "--ttt-step-loss-decay", 0.8, 1.0),
    Setting("lr", "--lr", 1e-4, 1e-3),
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
    Setting("(no input norm)", "--norm-before-fc", False, True, "an RMSNorm over the 3 concatenated aux states"),
    Setting("(pre-norm state fed back)", "--norm-output", False, True, "the state carried across TTT steps"),
    Setting("(DrafterConfig.norm_before_residual)", "--norm-before-residual", False, True,
            "draftsmith train has no flag for it: matched one way"),
    Setting("(full attention)", "--full-attention-indices", [0], [], "[]: sliding window 2048 in every layer"),
    Setting("(soft cross-entropy to the target)", "--loss-fn", "kl_div", "kl_div", "the same gradient"),
)
PER_RUN = ("epochs", "draft_vocab_size")  # set by the benchmark for every run, not by the mapping
# Value maps, the same both ways: train ratio = 1 - eval fraction; speculators' unset warm-up is 1 % of steps.
CONVERT = {"eval_fraction": lambda x: round(1 - x, 6), "warmup_ratio": lambda x: 0.01 if x is None else x}


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
`loss_backward_kernel.configs` (benchmarks/results/speculators_compare.json, `first_try`)."""


def speculators_argv(run: str, data: Path, target: Path, save: Path, aux_ids: list[int], epochs: float,
                     draft_vocab: int) -> list[str]:
    """The exact `speculators train` arguments of a run (aux ids as is: speculators reads boundaries)."""
    from draftsmith.conventions import TRAINER_CONVENTIONS, from_boundary

    ids = from_boundary(tuple(aux_ids), TRAINER_CONVENTIONS["speculators"])
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target), "--data-path", str(data),
            "--save-path", str(save), "--log-dir", str(save.parent / "logs"), "--target-layer-ids", *map(str, ids),
            "--epochs", str(max(1, math.ceil(epochs))), "--on-missing", "raise", *SPECULATORS_LOSS]
    if run == "speculators-matched":
        argv += [*speculators_matched_args(), "--draft-vocab-size", str(draft_vocab)]
    return argv


def draftsmith_values(run: str, store: Path, out: Path, epochs: float, vocab: int) -> dict[str, Any]:
    """TrainConfig fields of a draftsmith run (matched: speculators' full vocabulary too)."""
    values: dict[str, Any] = {"store": str(store), "out": str(out), "epochs": epochs}
    if run == "draftsmith-matched":
        values.update(draftsmith_matched_values(), draft_vocab_size=vocab)
    return values


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
    from draftsmith.convert import convert
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

        main(SpecConfig.resolve(spec["argv"]))  # what `speculators train ARGV` runs (cli/train.py)
        extra = {}
    else:
        from draftsmith.train import TrainConfig, Trainer

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


def run_one(run: str, args, work: Path, data: Path, target_dir: Path, aux_ids: list[int], vocab: int,
            lengths: list[int]) -> dict:
    """Train one run in a child process; its record for the results JSON."""
    from draftsmith.vocab import default_draft_vocab_size

    trainer = run.split("-")[0]
    out = work / run
    out.mkdir(parents=True, exist_ok=True)
    if trainer == "speculators":
        spec = {"trainer": trainer, "argv": speculators_argv(run, data, target_dir, out / "checkpoints", aux_ids,
                                                             args.epochs, default_draft_vocab_size(vocab))}
    else:
        spec = {"trainer": trainer, "values": draftsmith_values(run, Path(args.store), out / "train", args.epochs,
                                                                vocab)}
    (out / "spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    child = subprocess.run([sys.executable, __file__, "--child", str(out / "spec.json")], text=True)
    record: dict[str, Any] = {"run": run, **spec, "returncode": child.returncode}
    if child.returncode != 0:
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
    return record


def run_parent(args) -> dict:
    from draftsmith.interop import EXPORT_INFO, export_speculators, write_index
    from draftsmith.store import FeatureStore
    from draftsmith.target import resolve_target

    runs = args.only or list(RUNS)
    if any(r.startswith("speculators") for r in runs):
        if importlib.util.find_spec("speculators") is None:
            sys.exit(SPECULATORS_MISSING)
        if problems := requirement_problems():
            sys.exit("speculators' requirements are not met here:\n  " + "\n  ".join(problems)
                     + "\ncarry the wheels docs/peers.md lists (or the versions named above)")
    store = FeatureStore(Path(args.store))
    target_dir = resolve_target(args.target or store.identity["target"]["name"])
    work, data = Path(args.work), Path(args.work) / "speculators-data"
    if not (data / EXPORT_INFO).is_file():
        export_speculators(Path(args.store), data, str(target_dir), index=False)
    if any(r.startswith("speculators") for r in runs) and not (data / "state.json").is_file():
        if (index := write_index(data)) != "written":
            sys.exit(f"the speculators index of {data} is {index}")
    vocab = store.identity["target"]["vocab_size"]
    lengths = [store.sample_length(k) for k in range(len(store))]
    records = [run_one(r, args, work, data, target_dir, store.identity["aux_layer_ids"], vocab, lengths)
               for r in runs]
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "device": device,
            "torch": torch.__version__, "speculators": SPECULATORS_VERSION, "store": str(Path(args.store).resolve()),
            "target": str(target_dir), "epochs": args.epochs, "num_samples": len(store),
            "store_tokens": store.manifest["num_tokens"], "runs": records,
            "settings": [s.__dict__ for s in SETTINGS],
            "note": "wall_s covers the whole train call (model build, epochs, validation, checkpoint) for both "
                    "trainers; step_tokens_per_s (draftsmith only) sums its logged step times"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", help="feature store (draftsmith capture)")
    p.add_argument("--target", default=None, help="target name or directory (default: the store's)")
    p.add_argument("--work", default="/tmp/speculators_compare", help="working directory for the four runs")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs for every run (speculators: rounded up)")
    p.add_argument("--only", action="append", choices=RUNS, help="run only these (repeatable; default all four)")
    p.add_argument("--out", default=str(RESULTS), help="results JSON")
    p.add_argument("--check-env", action="store_true", help="only list speculators' unmet requirements here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
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
    result = run_parent(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in result["runs"]:
        peak = r.get("peak_gpu_mem_gib")
        print(f"{r['run']:22s} rc {r['returncode']} | {r.get('tokens_per_s', float('nan')):,.0f} tok/s | peak "
              f"{'-' if peak is None else f'{peak:.1f} GiB'} | convert {r.get('convert', {}).get('ok', '-')}")
    return 0 if all(r["returncode"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
