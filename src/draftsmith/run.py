"""`draftsmith run`: the pipeline in one run directory, each stage skipped when its output is complete.

Stages: regenerate -> capture -> train -> export -> eval. With no config, the embedded default: SmolLM2
on this CPU with the built-in prompts. Each stage records the hash of its settings and inputs in
`<run>/stages.json`; a rerun skips a stage whose hash is unchanged and whose outputs exist, and redoes
it (and everything after it) otherwise. Stages are resumable inside too: regenerate by id, capture by
shard, train from its last checkpoint.

Run: draftsmith run                      # the embedded default into runs/demo
     draftsmith run --out runs/x train.epochs=3 regenerate.limit=64
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class RegenerateStage:
    prompts: str = "train"
    limit: int = 256
    max_new_tokens: int = 128
    batch_size: int = 64
    temperature: float = 0.0


@dataclass(frozen=True)
class CaptureStage:
    max_length: int = 1024
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class TrainStage:
    epochs: float = 4.0
    lr: float = 1e-3
    batch_tokens: int = 4096
    ttt_steps: int = 4
    draft_vocab_size: int | None = 4096
    eval_fraction: float = 0.05
    seed: int = 0


@dataclass(frozen=True)
class EvalStage:
    prompts: str = "eval"
    limit: int = 6
    k: str = "4"
    max_new_tokens: int = 64


@dataclass(frozen=True)
class RunConfig:
    """The whole pipeline. Sections map to stages; `skip` names stages to leave out."""

    target: str = "smollm2"
    out: str = "runs/demo"
    skip: tuple[str, ...] = ()
    regenerate: RegenerateStage = field(default_factory=RegenerateStage)
    capture: CaptureStage = field(default_factory=CaptureStage)
    train: TrainStage = field(default_factory=TrainStage)
    eval: EvalStage = field(default_factory=EvalStage)


STAGES = ("regenerate", "capture", "train", "export", "eval")


def apply_override(cfg: RunConfig, dotted: str) -> RunConfig:
    """`section.field=value` (or `field=value` at top level) on a frozen config, type-converted."""
    if "=" not in dotted:
        raise DraftsmithError("bad override", got=dotted, expected="section.field=value", fix="e.g. train.lr=3e-4")
    key, value = dotted.split("=", 1)
    parts = key.split(".")
    if len(parts) == 1:
        names = {f.name: f for f in fields(cfg)}
        if parts[0] not in names or parts[0] in ("regenerate", "capture", "train", "eval"):
            raise DraftsmithError("unknown config key", got=key, expected=", ".join(n for n in names), fix="check the key")
        if parts[0] == "skip":
            return replace(cfg, skip=tuple(s for s in value.split(",") if s))
        return replace(cfg, **{parts[0]: value})
    section, name = parts
    if section not in ("regenerate", "capture", "train", "eval"):
        raise DraftsmithError("unknown config section", got=section, expected="regenerate | capture | train | eval",
                              fix="check the key")
    sub = getattr(cfg, section)
    types = {f.name: f.type for f in fields(sub)}
    if name not in types:
        import difflib

        close = difflib.get_close_matches(name, types, n=1)
        raise DraftsmithError(f"unknown key {section}.{name}", got=name, expected=", ".join(types),
                              fix=f"did you mean {section}.{close[0]}?" if close else "check the key")
    kind = types[name]
    conv = int if kind in ("int", "int | None") else float if kind == "float" else str
    return replace(cfg, **{section: replace(sub, **{name: None if value in ("none", "null") else conv(value)})})


def stage_hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_pipeline(cfg: RunConfig) -> dict:
    from draftsmith.capture import capture
    from draftsmith.conversations import ConversationWriter
    from draftsmith.export import export
    from draftsmith.prompts import load_prompts
    from draftsmith.regenerate import LocalSettings, regenerate_local
    from draftsmith.target import load_target, resolve_target
    from draftsmith.train import TrainConfig, Trainer

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    print("run: resolved config\n" + json.dumps(asdict(cfg), indent=2))
    state_path = out / "stages.json"
    done = json.loads(state_path.read_text()) if state_path.exists() else {}
    summary: dict = {"stages": {}}
    upstream = ""
    timings = {}

    conv_path, store, train_dir, export_dir = out / "conversations.jsonl", out / "store", out / "train", out / "export-vllm"
    outputs = {"regenerate": conv_path, "capture": store, "train": train_dir, "export": export_dir,
               "eval": out / "eval.json"}

    def should_run(stage: str, h: str) -> bool:
        """Run unless finished with the same hash. Started with another hash: wipe its output first;
        started with the same hash but not finished (killed): keep it, the stage resumes inside."""
        if stage in cfg.skip:
            return False
        entry = done.get(stage) or {}
        if entry.get("hash") == h and entry.get("complete"):
            return False
        if entry.get("hash") != h:
            target = outputs[stage]
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            done[stage] = {"hash": h, "complete": False}
            state_path.write_text(json.dumps(done, indent=2) + "\n")
        return True

    def mark(stage: str, h: str, seconds: float) -> None:
        done[stage] = {"hash": h, "complete": True}
        state_path.write_text(json.dumps(done, indent=2) + "\n")
        timings[stage] = seconds
    # regenerate
    h = stage_hash(cfg.target, asdict(cfg.regenerate))
    prompts = load_prompts(cfg.regenerate.prompts, cfg.regenerate.limit)
    if should_run("regenerate", h):
        t = time.perf_counter()
        model, tokenizer = load_target(resolve_target(cfg.target))
        r = cfg.regenerate
        with ConversationWriter(conv_path) as writer:
            regenerate_local(prompts, model, tokenizer, writer, LocalSettings(r.max_new_tokens, r.batch_size, r.temperature),
                             target_name=cfg.target)
        del model
        mark("regenerate", h, time.perf_counter() - t)
    upstream = h
    # capture
    h = stage_hash(upstream, asdict(cfg.capture))
    if should_run("capture", h):
        t = time.perf_counter()
        capture(conv_path, store, cfg.target, max_length=cfg.capture.max_length, dtype=cfg.capture.dtype)
        mark("capture", h, time.perf_counter() - t)
    upstream = h
    # train
    h = stage_hash(upstream, asdict(cfg.train))
    if should_run("train", h):
        t = time.perf_counter()
        tr = cfg.train
        trainer = Trainer(TrainConfig(out=str(train_dir), store=str(store), epochs=tr.epochs, lr=tr.lr,
                                      batch_tokens=tr.batch_tokens, ttt_steps=tr.ttt_steps,
                                      draft_vocab_size=tr.draft_vocab_size, eval_fraction=tr.eval_fraction,
                                      seed=tr.seed, log_every=10, eval_every=10**9, save_every=50))
        trainer.run()
        mark("train", h, time.perf_counter() - t)
    upstream = h
    eval_result = json.loads((train_dir / "drafter" / "config.json").read_text())["draftsmith"].get("eval", {})
    summary["simulated_tau"] = eval_result.get("tau", {})
    # export
    h = stage_hash(upstream, "vllm")
    if should_run("export", h):
        t = time.perf_counter()
        export(train_dir / "drafter", export_dir, "vllm", dtype="float32", target_path=str(resolve_target(cfg.target)))
        mark("export", h, time.perf_counter() - t)
    upstream = h
    # eval
    h = stage_hash(upstream, asdict(cfg.eval))
    if should_run("eval", h):
        t = time.perf_counter()
        from draftsmith.eval import recommend, run_eval

        e = cfg.eval
        results = run_eval(cfg.target, train_dir / "drafter", e.prompts, [int(k) for k in e.k.split(",")], e.limit,
                           0.0, e.max_new_tokens, "vllm", "float32", True, 0)
        best = recommend(results)
        (out / "eval.json").write_text(json.dumps({**asdict(best), "sweep": [asdict(r) for r in results]}, indent=2))
        mark("eval", h, time.perf_counter() - t)
    if (out / "eval.json").exists():
        summary["eval"] = json.loads((out / "eval.json").read_text())
    summary["drafter"] = str(export_dir)
    summary["stage_seconds"] = timings
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def add_parser(sub) -> None:
    from draftsmith.cli import example_help

    p = sub.add_parser("run", help="the whole pipeline on one run directory (default: embedded SmolLM2 demo)",
                       **example_help(
                           "examples:\n"
                           "  draftsmith run                                   # embedded default into runs/demo\n"
                           "  draftsmith run --out runs/x train.epochs=2 eval.k=1,2,3,4\n"
                           "  draftsmith run skip=eval\n"
                           "A rerun skips finished stages and resumes an interrupted one."))
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--out", default=None, help="run directory (default runs/demo)")
    p.set_defaults(func=run_cli)


def run_cli(args) -> int:
    cfg = RunConfig()
    for o in args.overrides:
        cfg = apply_override(cfg, o)
    if args.out:
        cfg = replace(cfg, out=args.out)
    t = time.perf_counter()
    s = run_pipeline(cfg)
    tau = s.get("simulated_tau", {})
    print(f"\nrun: drafter -> {s['drafter']}")
    print(f"run: simulated acceptance length (teacher-forced, held-back samples): "
          + ", ".join(f"k={k}: {v:.2f}" for k, v in tau.items()))
    if "eval" in s:
        e = s["eval"]
        print(f"run: eval tau at k={e['k']}: {e['tau']:.2f}, speed-up {e['speedup']:.2f}x over plain greedy decoding")
    print(f"run: wall time {time.perf_counter() - t:.0f} s")
    return 0
