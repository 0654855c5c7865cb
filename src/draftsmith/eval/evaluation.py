"""`draftsmith eval`: decode with target and drafter, count what is accepted, and measure the speed-up.

tau (mean acceptance length) = accepted draft tokens + 1 bonus token per verification step, the
definition vLLM's `Mean acceptance length` and SGLang's `accept len` use. per_position[i] = share of
verification steps whose draft token i+1 was accepted (vLLM's `accepted_per_pos / num_drafts`).

Drafting is a chain of k tokens (vLLM) or, with --topk > 1, an EAGLE-2 tree of --draft-tokens nodes and depth
k (SGLang's --speculative-eagle-topk / --speculative-num-draft-tokens / --speculative-num-steps). With
--batch-size B, B prompts decode together, each with its own acceptance; the baseline runs at the same batch.

Run: draftsmith eval --drafter runs/demo/train/drafter --prompts eval --limit 20 --k 1,2,3,4,5 --json eval.json
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import Field, model_validator

from draftsmith.config import Count, Settings, add_flags, check_choices, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.outputs import foreign_entries, mark


@dataclass(frozen=True)
class KResult:
    k: int
    """Draft depth: the chain length, or the tree depth (SGLang --speculative-num-steps)."""
    tau: float
    per_position: list[float]
    """per_position[i] = share of verification steps that accepted at least i+1 draft tokens."""
    histogram: list[int]
    """histogram[a] = verification steps that accepted exactly a draft tokens (a = 0..k)."""
    tokens_per_s_spec: float
    tokens_per_s_base: float | None
    """None when no baseline was decoded (--no-baseline); so is speedup."""
    speedup: float | None
    verify_steps: int
    generated_tokens: int
    overhead_share: float
    """Share of speculative wall time outside target and drafter forwards."""
    identical_to_target: bool | None
    """Greedy only: every output equals the target's own greedy output."""
    topk: int = 1
    """Children per expanded tree node; 1 = chain."""
    draft_tokens: int = 0
    """Tree nodes verified per step, the root included (SGLang --speculative-num-draft-tokens); k + 1 for a chain."""
    batch_size: int = 1
    divergence: dict | None = None
    """Greedy output that differs: the decisive first divergence (sequence, position, the target's top-2 logit gap
    there, the dtype's flip tolerance, near_tie), how many sequences diverged and a note saying so; None when
    identical."""


def divergence_note(d: dict) -> str:
    """One sentence on where greedy output first left the target's and what the top-2 logit gap says about it."""
    where = f"sequence {d['sequence']}, token {d['position']}" + \
        (f" (and {d['sequences'] - 1} more sequence(s))" if d.get("sequences", 1) > 1 else "")
    if d["gap"] is None:
        return f"greedy output first differs at {where}, past the end of the target's own output"
    gap = f"the target's top two logits are {d['gap']:.4g} apart"
    if d["near_tie"]:
        return (f"greedy output first differs at {where}, where {gap}, within the {d['tolerance']:.3g} that "
                f"{d['dtype']} rounding can flip: a near-tie, not a bug")
    limit = f"above the {d['tolerance']:.3g} {d['dtype']} rounding can flip" if d["tolerance"] else \
        f"and {d['dtype']} decoding is exact"
    return f"greedy output first differs at {where}, where {gap}, {limit}"


def decisive(divergences: list) -> dict | None:
    """The divergence that decides the verdict: the first one that is no near-tie (a bug), else the first."""
    if not divergences:
        return None
    worst = next((d for d in divergences if not d.near_tie), divergences[0])
    out = {**asdict(worst), "sequences": len(divergences)}
    return {**out, "note": divergence_note(out)}


def summarize(k: int, accepted: list[int], spec_tokens: int, spec_s: float, base_tokens: int, base_s: float,
              model_s: float, identical: bool | None, topk: int = 1, draft_tokens: int | None = None,
              batch_size: int = 1, divergence: dict | None = None) -> KResult:
    steps = len(accepted)
    hist = [sum(1 for a in accepted if a == i) for i in range(k + 1)]
    per_pos = [sum(1 for a in accepted if a > i) / max(steps, 1) for i in range(k)]
    tps_spec = spec_tokens / max(spec_s, 1e-9)
    tps_base = base_tokens / max(base_s, 1e-9) if base_s else None
    return KResult(k=k, tau=(sum(accepted) / max(steps, 1)) + 1.0, per_position=per_pos, histogram=hist,
                   tokens_per_s_spec=tps_spec, tokens_per_s_base=tps_base, speedup=tps_spec / tps_base if tps_base else None,
                   verify_steps=steps, generated_tokens=spec_tokens, overhead_share=max(0.0, 1 - model_s / max(spec_s, 1e-9)),
                   identical_to_target=identical, topk=topk, draft_tokens=draft_tokens or k + 1, batch_size=batch_size,
                   divergence=divergence)


@dataclass
class Totals:
    """What one k's run over the prompt set adds up."""

    accepted: list[int]
    spec_tokens: int = 0
    spec_s: float = 0.0
    model_s: float = 0.0
    base_tokens: int = 0
    base_s: float = 0.0
    identical: bool = True
    divergences: list = field(default_factory=list)
    sequences: int = 0


def turn_batches(prompts, batch_size: int):
    """Groups of at most batch_size prompts, each answered turn by turn: yields (group, conversations so far)
    lists whose last message is the user turn to answer; the caller appends the answer to each conversation."""
    for start in range(0, len(prompts), batch_size):
        group = prompts[start:start + batch_size]
        convs, cursors = [[] for _ in group], [0] * len(group)
        while True:
            owners = []
            for j, p in enumerate(group):
                while cursors[j] < len(p.messages):
                    msg = p.messages[cursors[j]]
                    cursors[j] += 1
                    convs[j].append(msg)
                    if msg["role"] == "user":
                        owners.append(j)
                        break
            if not owners:
                break
            yield start, [convs[j] for j in owners]


class EvalSettings(Settings):
    """How `eval` decodes: the eval verb's flags and `run`'s eval section."""

    prompts: str = "eval"
    """eval (HumanEval) | chat-eval | humaneval | train | a JSONL of prompt / messages / turns records."""
    limit: int | None = Field(20, ge=1)
    """Decode the first N prompts (null: all)."""
    k: tuple[Count, ...] = (4,)
    """Draft lengths (tree depths) to sweep; the best is the recommended k."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens generated per prompt."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy (then speculative output must equal the target's)."""
    engine: str = "trained"
    """Read the drafter's aux ids as this engine would: trained | vllm | sglang."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    device: str = "cpu"
    """Where target and drafter run: cpu | cuda | cuda:N | auto (cuda when there is one)."""
    baseline: bool = True
    """Also decode without speculation (the speed-up's denominator)."""
    seed: int = Field(0, ge=0)
    """Seed of sampled decoding (temperature > 0)."""
    batch_size: int = Field(1, ge=1)
    """Prompts decoded together (per-sequence acceptance)."""
    topk: int = Field(1, ge=1)
    """Tree drafting: children per expanded node (SGLang --speculative-eagle-topk); 1 = chain."""
    draft_tokens: int | None = Field(None, ge=1)
    """Tree nodes verified per step, root included (SGLang --speculative-num-draft-tokens)."""
    cpu_pack: bool = True
    """CPU, float32: pack the target's linear weights once (MKL) for the row counts the verification runs at, which
    makes verifying k + 1 tokens cheaper (cpu_gemm.py, benchmarks/cpu_gemm.py); false: plain F.linear throughout."""

    @model_validator(mode="after")
    def check_choices(self) -> EvalSettings:
        check_choices(("--engine", self.engine, ("trained", "vllm", "sglang")),
                      ("--dtype", self.dtype, ("float32", "bfloat16")))
        return self

    def record(self) -> dict:
        """The settings as eval.json and eval.md name them."""
        return {"prompts": self.prompts, "limit": self.limit, "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens, "engine": self.engine, "dtype": self.dtype,
                "device": self.device, "batch": self.batch_size, "drafting": "tree" if self.topk > 1 else "chain",
                "cpu_pack": self.cpu_pack}


def check_drafter_fits(drafter, spec, target_name: str, drafter_dir: Path) -> None:
    """A drafter trained for another target (its embedding, the target's, or the hidden states it reads differ)
    is named from the configs, before the target loads."""
    cfg = drafter.config
    theirs = (cfg.vocab_size, cfg.hidden_size, cfg.target_hidden_size)
    if theirs != (spec.vocab_size, spec.hidden_size, spec.hidden_size):
        raise DraftsmithError(f"the drafter {drafter_dir} was not made for the target {target_name}",
                              got=f"drafter: vocab {cfg.vocab_size}, embedding width {cfg.hidden_size}, reads hidden "
                                  f"states of width {cfg.target_hidden_size}",
                              expected=f"the target's vocab {spec.vocab_size} and hidden size {spec.hidden_size}",
                              fix="pass the drafter's own target with --target (its config.json's draftsmith.target "
                                  "names it)")


def run_eval(target_name: str, drafter_dir: Path, s: EvalSettings) -> list[KResult]:
    """Decode the prompt set with speculation for each k (the tree depth when topk > 1) and without.

    `s` is the eval verb's settings (and run's eval section), passed whole. Among them: batch_size, the prompts
    decoded together (per-sequence acceptance; the baseline runs at the same batch); topk and draft_tokens, the tree
    settings (SGLang's --speculative-eagle-topk / --speculative-num-draft-tokens; topk 1 is a chain of k tokens);
    device, where target and drafter run; cpu_pack, pack the target's linears for the row counts decoded
    (`cpu_gemm.pack_linears`; CPU float32 only).
    """
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.model.checkpoint import load_drafter, read_drafter_config
    from draftsmith.model.eagle3 import Eagle3Drafter
    from draftsmith.conventions import engine_aux_ids
    from draftsmith.eval.cpu_gemm import pack_linears
    from draftsmith.eval.decoder import (DecodeSettings, check_block_settings, decode_batch, first_divergence,
                                        masked_gqa, target_decode)
    from draftsmith.model.dflash import DFlashDrafter
    from draftsmith.progress import progress_bar
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import describe_target, load_target, pick_device, read_config, resolve_target

    ks, limit, temperature, max_new_tokens = list(s.k), s.limit, s.temperature, s.max_new_tokens
    engine, dtype, baseline, device, seed = s.engine, s.dtype, s.baseline, s.device, s.seed
    batch_size, topk, draft_tokens = s.batch_size, s.topk, s.draft_tokens
    model_dir = resolve_target(target_name)
    spec = describe_target(read_config(model_dir))
    # the inputs first: a bad prompts file or a cut drafter is named before the target loads
    prompts = load_prompts(s.prompts, limit)
    pick_device(device)
    drafter_config = read_drafter_config(Path(drafter_dir))
    drafter = load_drafter(drafter_dir)
    check_drafter_fits(drafter, spec, target_name, drafter_dir)
    if isinstance(drafter, DFlashDrafter):  # a block drafts at most block size - 1 tokens, as a chain
        for k in ks:
            check_block_settings(drafter, DecodeSettings(k=k, topk=topk, draft_tokens=draft_tokens))
    aux_ids = engine_aux_ids(drafter_config, spec.num_layers, engine)
    if max(aux_ids) >= spec.num_layers:
        raise DraftsmithError(f"{engine} would read aux ids {list(aux_ids)}, past the target's {spec.num_layers} layers",
                              got=str(drafter_config.get("eagle_config")), expected="ids inside the target",
                              fix="re-export the drafter for this engine: draftsmith export --format " + engine)
    target, tokenizer = load_target(model_dir, dtype=dtype, device=device)
    if isinstance(drafter, Eagle3Drafter):  # its frozen embedding is the target's (DFlash's forwards take the target's)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    drafter = drafter.to(device=target.device, dtype=getattr(torch, dtype)).eval()
    masked_gqa(target.device)
    if s.cpu_pack and target.device.type == "cpu":
        nodes = [DecodeSettings(k=k, topk=topk, draft_tokens=draft_tokens).nodes for k in ks]
        # rows per forward: a full batch verifying its tree; the baseline at batch > 1 (batch 1 runs single rows)
        rows = {batch_size * n for n in nodes} | ({batch_size} if batch_size > 1 and baseline else set())
        print(pack_linears(target, rows).line(), file=sys.stderr, flush=True)
    results = []
    for k in ks:
        settings = DecodeSettings(k=k, temperature=temperature, max_new_tokens=max_new_tokens,
                                  eos_token_id=tokenizer.eos_token_id, topk=topk, draft_tokens=draft_tokens)
        plain = DecodeSettings(k=0, temperature=temperature, max_new_tokens=max_new_tokens,
                               eos_token_id=tokenizer.eos_token_id)
        tot = Totals(accepted=[])
        with progress_bar(f"eval k={k}", total=len(prompts), unit="prompts") as bar:
            done = -1
            for n, convs in turn_batches(prompts, batch_size):
                ids = [prompt_ids(tokenizer, c) for c in convs]
                res = decode_batch(target, drafter, ids, aux_ids, settings, seed=seed + n)
                for acc in res.accepted:
                    tot.accepted += acc
                tot.spec_tokens += sum(len(t) for t in res.tokens)
                tot.spec_s, tot.model_s = tot.spec_s + res.seconds, tot.model_s + res.target_seconds + res.drafter_seconds
                if baseline:  # batch 1: transformers' own decoding; batch > 1: the same batched loop, no drafter
                    if len(ids) == 1:
                        one = target_decode(target, ids[0], plain, seed=seed + n)
                        base_tokens, base_s = [one.tokens], one.seconds
                    else:
                        many = decode_batch(target, None, ids, (), plain, seed=seed + n)
                        base_tokens, base_s = many.tokens, many.seconds
                    tot.base_tokens += sum(len(t) for t in base_tokens)
                    tot.base_s += base_s
                    tot.identical &= temperature > 0 or base_tokens == res.tokens
                    for j, (b, t) in enumerate(zip(base_tokens, res.tokens)):
                        if temperature <= 0 and b != t:  # the target's own decode of it, with its top-2 logits
                            ref = one if len(ids) == 1 else target_decode(target, ids[j], plain)
                            if d := first_divergence(tot.sequences + j, ref, t, target.dtype):
                                tot.divergences.append(d)
                tot.sequences += len(ids)
                for c, t in zip(convs, res.tokens):
                    c.append({"role": "assistant", "content": tokenizer.decode(t, skip_special_tokens=True)})
                if n != done:
                    bar.advance(min(batch_size, len(prompts) - n), tokens=tot.spec_tokens)
                    done = n
        results.append(summarize(k, tot.accepted, tot.spec_tokens, tot.spec_s, tot.base_tokens, tot.base_s,
                                 tot.model_s, tot.identical if baseline and temperature <= 0 else None,
                                 topk=topk, draft_tokens=settings.nodes, batch_size=batch_size,
                                 divergence=decisive(tot.divergences)))
    return results



def recommend(results: list[KResult]) -> KResult:
    """The k with the best measured speed-up (best tau when no baseline was measured)."""
    if all(r.speedup is not None for r in results):
        return max(results, key=lambda r: r.speedup)
    return max(results, key=lambda r: r.tau)


def report_markdown(results: list[KResult], settings: dict) -> str:
    best = recommend(results)
    lines = ["# draftsmith eval", "",
             "| k (depth) | topk | draft tokens | tau | per-position acceptance | tok/s spec | tok/s base | speed-up | overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    def measured(x: float | None, spec: str, unit: str = "") -> str:  # None: no baseline was decoded (--no-baseline)
        return "n/a" if x is None else f"{x:{spec}}{unit}"

    for r in results:
        lines.append(f"| {r.k} | {r.topk} | {r.draft_tokens} | {r.tau:.2f} | {' '.join(f'{p:.2f}' for p in r.per_position)} | "
                     f"{r.tokens_per_s_spec:.1f} | {measured(r.tokens_per_s_base, '.1f')} | {measured(r.speedup, '.2f', 'x')} | "
                     f"{r.overhead_share:.1%} |")
    lines += ["", f"Recommended k: **{best.k}** (tau {best.tau:.2f}, speed-up {measured(best.speedup, '.2f', 'x')}).", "",
              "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())]
    return "\n".join(lines) + "\n"


def plot(results: list[KResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    best = recommend(results)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, best.k + 1), best.per_position, color="#3b7dd8")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title=f"per-position acceptance (k={best.k}, topk={best.topk})")
    fig.tight_layout()
    fig.savefig(out / "per_position.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ks = [r.k for r in results]
    ax.plot(ks, [r.tau for r in results], "o-", label="tau")
    if all(r.speedup is not None for r in results):
        ax.plot(ks, [r.speedup for r in results], "s-", label="speed-up")
    ax.set(xlabel="k (draft tokens)", title="tau and speed-up against k")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_vs_k.png", dpi=120)
    plt.close(fig)
    return [out / "per_position.png", out / "tau_vs_k.png"]


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("eval", help="reference speculative decoding: acceptance and speed-up",
                       **example_help(
                           "examples:\n"
                           "  draftsmith eval --drafter runs/demo/train/drafter --prompts eval --limit 20 --k 4\n"
                           "  draftsmith eval --drafter DIR --k 1,2,3,4,5,6,7 --json sweep.json --out report/\n"
                           "  draftsmith eval --drafter DIR --engine sglang   # read aux ids the way SGLang would\n"
                           "  draftsmith eval --drafter DIR --topk 4 --draft-tokens 8 --depth 5   # SGLang's default tree\n"
                           "  draftsmith eval --drafter DIR --k 3 --batch-size 4"))
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True,
                   help="drafter directory, or a shipped drafter's short name (smollm2: the embedded target's)")
    p.add_argument("--k", default=None, help="draft length (tree depth), or a comma list to sweep (1,2,3,4)")
    p.add_argument("--depth", type=int, default=None,
                   help="tree depth (SGLang --speculative-num-steps); replaces --k; default: draft-tokens - 1")
    add_flags(p, EvalSettings, skip=("k",))
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--out", type=Path, default=None, help="directory for eval.md and PNG plots")
    p.add_argument("--overwrite", action="store_true", help="replace a --json file, or write into an --out folder, "
                   "that draftsmith did not write")
    p.set_defaults(func=run_eval_cli)


def is_eval_json(path: Path) -> bool:
    """A results file `draftsmith eval --json` wrote (its own keys), which a rerun may replace."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"recommended_k", "sweep", "settings"} <= data.keys()


def check_eval_outputs(args) -> None:
    """The outputs, before the target loads: --json a new file or eval's own, --out a folder, --topk within the
    drafter's draft vocabulary."""
    from draftsmith.model.checkpoint import draftsmith_drafter_config, read_drafter_config
    from draftsmith.outputs import check_apart, check_output, check_output_file

    inputs = {"--prompts": args.prompts, "--drafter": args.drafter}  # never written over, even with --overwrite
    check_apart(args.json, "eval", "--json", inputs)
    check_apart(args.out, "eval", "--out", inputs)
    if args.json:
        check_output_file(args.json, "eval", args.overwrite, owns=is_eval_json)
    if args.out:  # a folder of the user's is refused (its own eval.md was replaced)
        check_output(args.out, "eval", args.overwrite)
    config = read_drafter_config(Path(args.drafter))
    if "draftsmith" in config:  # a drafter that contradicts itself is named before the target loads
        draftsmith_drafter_config(config, Path(args.drafter))
    vocab = config.get("draft_vocab_size")
    if isinstance(vocab, int) and args.topk > vocab:
        raise DraftsmithError("--topk is larger than the drafter's draft vocabulary", got=f"--topk {args.topk}",
                              expected=f"<= {vocab} (draft_vocab_size)", fix="e.g. --topk 4 --draft-tokens 8")


def run_eval_cli(args) -> int:
    try:
        ks = [int(k) for k in str(args.k or 4).split(",")]
    except ValueError as exc:
        raise DraftsmithError("bad --k", got=args.k, expected="an integer or a comma list", fix="--k 4 or --k 1,2,3") from exc
    if args.topk > 1 and args.draft_tokens is None:
        raise DraftsmithError("a tree needs its node budget", got=f"--topk {args.topk} without --draft-tokens",
                              expected="--draft-tokens M (root included)", fix="--topk 4 --draft-tokens 8 --depth 5")
    if args.depth is not None:
        ks = [args.depth]
    elif args.topk > 1 and args.k is None:
        ks = [args.draft_tokens - 1]  # deep enough for any path the node budget allows
    from draftsmith.model.checkpoint import drafter_path

    args.drafter = drafter_path(args.drafter)
    s = from_flags(EvalSettings, args, k=ks)
    check_eval_outputs(args)
    results = run_eval(args.target, args.drafter, s)
    settings = {"target": args.target, "drafter": str(args.drafter), **s.record(),
                "topk": args.topk, "draft_tokens": args.draft_tokens, "depth": ks if len(ks) > 1 else ks[0]}
    best = recommend(results)
    print(report_markdown(results, settings))
    payload = {**asdict(best), "recommended_k": best.k, "prompts": args.prompts, "sweep": [asdict(r) for r in results],
               "settings": settings}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval.md").write_text(report_markdown(results, settings))
        plot(results, args.out)
        mark(args.out, "eval", foreign_entries(args.out))
    if best.identical_to_target is False:
        if best.divergence and best.divergence["near_tie"]:
            print(f"eval: note: {best.divergence['note']}")
            return 0
        detail = f": {best.divergence['note']}" if best.divergence else ""
        print(f"eval: WARNING: greedy speculative output differs from the target's greedy output{detail}")
        return 1
    return 0
