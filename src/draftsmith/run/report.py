"""`draftsmith report`: one page about a run directory, in markdown and HTML, every number also in JSON.

Reads only what the stages left in the run directory (`run_config.json`, `summary.json`,
`conversations.jsonl`, `store/manifest.json`, `train/metrics.jsonl`, `eval.json`, `check.json`,
`launch.json`, `guard.json`, `bench/bench.json`, `bench/llamacpp.json`) and writes next to them:

- `report.json`: every number on the page;
- `report.md` with `report-*.png` plots beside it, and `report.html`, which embeds the same plots and
  needs no other file.

The verdict at the top comes from bench (the drafter measured in each engine, vLLM and llama.cpp, against the
same engine without speculation: go when every engine measured is faster with it) when it ran, else from eval
(the reference speculative decoder); a failed stage is a no-go: the rules of bench.verdict.decide_run, the same
module bench decides by. The plots are run/plots.py's. `draftsmith run` writes the report at its end; this verb
re-renders it.

Run: draftsmith report runs/demo
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from draftsmith.bench.render import fmt
from draftsmith.bench.verdict import decide_run
from draftsmith.client import redact
from draftsmith.config import JSON_FLAG, Settings, add_flags, from_flags
from draftsmith.errors import DraftsmithError
from draftsmith.run.state import RunState
from draftsmith.run.plots import PLOTS, plot_all


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------- numbers


def data_summary(run: Path, target: str | None) -> dict | None:
    """Conversations, assistant turns, tokens and the share of them that is reasoning."""
    from draftsmith.regenerate.conversations import read_conversations

    path = run / "conversations.jsonl"
    if not path.exists() or not RunState.load(run).started("regenerate"):
        return None  # a file of that name that no stage of this run wrote is not the run's data
    answers, reasoning, conversations, turns = [], [], 0, 0
    for conv in read_conversations(path):
        conversations += 1
        for m in conv.messages:
            if m["role"] == "assistant":
                turns += 1
                answers.append(m.get("content") or "")
                reasoning.append(m.get("reasoning_content") or "")
    tokenizer = local_tokenizer(target)
    unit = "tokens" if tokenizer else "characters"

    def size(texts: list[str]) -> int:
        if not tokenizer:
            return sum(len(t) for t in texts)
        return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0

    answer_n, reasoning_n = size(answers), size([r for r in reasoning if r])
    out = {"conversations": conversations, "assistant_turns": turns, "unit": unit,
           "assistant_" + unit: answer_n + reasoning_n, "reasoning_" + unit: reasoning_n,
           "reasoning_share": reasoning_n / max(answer_n + reasoning_n, 1),
           "with_reasoning": sum(1 for r in reasoning if r)}
    manifest = read_json(run / "store" / "manifest.json")
    if manifest:
        out["store"] = {k: manifest.get(k) for k in ("num_samples", "num_tokens", "num_supervised_tokens")}
    regen = read_json(run / "regenerate.json")
    if regen:
        out["regenerate"] = {k: regen.get(k) for k in ("done", "skipped", "output_tokens", "seconds", "conversations",
                                                      "multi_turn", "first_turns", "follow_ups") if k in regen}
    return out


def start_description(cfg: dict) -> str:
    """Where training started: from scratch, or the drafter named by train.init_from (and where that came from)."""
    from draftsmith.train.settings import starting_drafter as resolve

    start = resolve((cfg.get("train") or {}).get("init_from"), str(cfg.get("target", "")),
                    tuple((cfg.get("export") or {}).get("formats") or ()))
    name = start.drafter
    if not name:
        return f"trained from scratch (train.init_from: {start.why})"
    from draftsmith.model.checkpoint import drafter_path

    card = drafter_path(name) / "build.json"
    origin = ""
    if card.is_file():
        build = json.loads(card.read_text())
        origin = f": {build.get('summary', '')}"
    return f"fine-tuned from `{name}` ({drafter_path(name)}){origin}"


def local_tokenizer(target: str | None):
    """The target's tokenizer when it is on this machine (never a download), else None."""
    if not target:
        return None
    try:
        from transformers import AutoTokenizer

        from draftsmith.target import resolve_target

        if target != "smollm2" and not Path(target).expanduser().exists():
            return None
        return AutoTokenizer.from_pretrained(str(resolve_target(target)), local_files_only=True)
    except (DraftsmithError, OSError, ValueError):
        return None


def training_summary(path: Path) -> dict | None:
    """Loss and per-TTT-step accuracy per optimizer step (the last record of a step wins: a resumed run
    repeats the steps after its last checkpoint), and the held-back evaluations."""
    if not path.exists():
        return None
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "eval" in rec:
            evals[rec["step"]] = rec["eval"]
        elif "acc" in rec:
            steps[rec["step"]] = rec
    if not steps:
        return None
    order = sorted(steps)
    first, last = steps[order[0]], steps[order[-1]]
    return {"steps": len(order), "step": order, "loss": [steps[s]["loss"] for s in order],
            "acc": [steps[s]["acc"] for s in order], "first_loss": first["loss"], "final_loss": last["loss"],
            "first_acc": first["acc"], "final_acc": last["acc"],
            "tokens_per_s": sum(steps[s]["tok_per_s"] for s in order) / len(order),
            # the conversations' own tokens (padding excluded); logs from before it was recorded have none
            "useful_tokens_per_s": (sum(steps[s]["real_tok_per_s"] for s in order) / len(order)
                                    if all("real_tok_per_s" in steps[s] for s in order) else None),
            "evals": [{"step": s, **evals[s]} for s in sorted(evals)]}


def eval_summary(data: dict | None) -> dict | None:
    if not data:
        return None
    keep = ("k", "tau", "per_position", "histogram", "speedup", "tokens_per_s_spec", "tokens_per_s_base",
            "identical_to_target", "divergence", "generated_tokens", "verify_steps")
    return {**{k: data.get(k) for k in keep}, "settings": data.get("settings", {}),
            "sweep": [{k: r[k] for k in ("k", "tau", "speedup", "per_position")} for r in data.get("sweep", [])]}


def bench_summary(data: dict | None) -> dict | None:
    if not data:
        return None
    levels = [{"concurrency": lv["concurrency"], "output_tokens_per_s": lv["output_tokens_per_s"],
               "baseline_output_tokens_per_s": lv["baseline_output_tokens_per_s"], "speedup": lv["speedup"],
               "tau": lv["tau"], "tpot_ms_p50": lv["tpot_ms_p50"], "failed": lv["failed"]} for lv in data["levels"]]
    s = data["settings"]
    return {"tau": data["tau"], "acceptance_rate": data["acceptance_rate"], "per_position": data["per_position"],
            "k": s.get("num_speculative_tokens"), "levels": levels, "verdict": data["verdict"],
            "settings": {**{k: s[k] for k in ("prompts", "num_prompts", "max_tokens", "temperature", "warmup")},
                         "rounds": s.get("rounds", 1)},  # bench.json from before rounds: one round
            "sweep": data.get("sweep")}


def llamacpp_summary(data: dict | None) -> dict | None:
    """bench/llamacpp.json as bench_summary reads it, plus the p-min llama-server drafted with."""
    summary = bench_summary(data)
    return summary and {**summary, **{k: data[k] for k in ("p_min", "target_gguf", "drafter_gguf")}}


def k_choices(ev: dict | None, bench: dict | None, llama: dict | None) -> list[dict]:
    """Which k each engine used and why: the reference decoder's from eval's sweep, vLLM's and llama.cpp's from
    bench's."""
    out = []
    if ev:
        sweep = ", ".join(f"k={r['k']} {fmt(r['speedup'])}x" for r in ev["sweep"])
        s = ev["settings"]
        why = (f"the best measured speed-up of its sweep ({sweep}); PyTorch on this machine, {s.get('limit')} "
               f"`{s.get('prompts')}` prompts, batch 1" if ev["speedup"] is not None else
               "the best tau of its sweep (no baseline decoded, so no speed-up to choose by)")
        out.append({"engine": "reference decoder", "k": ev["k"], "why": why})
    if bench:
        sw = bench.get("sweep")
        if sw:
            s = bench["settings"]
            why = (f"{sw['choice']['reason']}; measured in the engine, one server per k against one baseline "
                   f"server, {s['num_prompts']} `{s['prompts']}` requests per level{rounds_phrase(s['rounds'])}")
        else:
            why = "the one k the bench stage served (no sweep recorded)"
        out.append({"engine": "vLLM", "k": bench["k"], "why": why})
    if llama:
        s = llama["settings"]
        out.append({"engine": "llama.cpp", "k": llama["k"],
                    "why": f"{llama['sweep']['choice']['reason']}; measured in llama-server at batch 1, drafts ending "
                           f"below p-min {llama['p_min']:g}, one server per k against one plain llama-server, "
                           f"{s['num_prompts']} `{s['prompts']}` requests{rounds_phrase(s['rounds'])}"})
    return out


def parity(ev: dict | None, bench: dict | None) -> dict | None:
    """The engine's tau next to the reference decoder's at the same k."""
    if not ev or not bench or bench.get("tau") is None:
        return None
    ref = next((r for r in ev["sweep"] if r["k"] == bench["k"]), None)
    return {"k": bench["k"], "engine_tau": bench["tau"], "reference_tau": ref["tau"] if ref else None,
            "difference": bench["tau"] - ref["tau"] if ref else None,
            "engine_per_position": bench["per_position"], "reference_per_position": ref["per_position"] if ref else None,
            "note": "on different prompts and output lengths: bench's, not eval's" if ref else
                    f"eval did not measure k={bench['k']}"}


def collect(run: Path) -> dict:
    """Everything the page shows, as one JSON document, credentials redacted."""
    run = Path(run)
    cfg = read_json(run / "run_config.json")
    if cfg is None:
        raise DraftsmithError("not a run directory", got=str(run), expected="a directory written by `draftsmith run`",
                              fix="pass the --out of a run, e.g. runs/demo")
    summary = read_json(run / "summary.json") or {}
    drafter = read_json(run / "train" / "drafter" / "config.json")
    ev = eval_summary(read_json(run / "eval.json"))
    bench = bench_summary(read_json(run / "bench" / "bench.json"))
    llama = llamacpp_summary(read_json(run / "bench" / "llamacpp.json"))
    doc = {"run": str(run), "target": cfg["target"], "config": cfg,
           "summary": {k: summary.get(k) for k in ("stages", "skipped", "stage_seconds", "failed")},
           "data": data_summary(run, cfg["target"]), "starting_drafter": start_description(cfg), "training": training_summary(run / "train" / "metrics.jsonl"),
           "simulated_tau": (drafter or {}).get("draftsmith", {}).get("eval", {}).get("tau"),
           "selection": (drafter or {}).get("draftsmith", {}).get("selection"),
           "eval": ev, "check": read_json(run / "check.json"), "launch": read_json(run / "launch.json"),
           "guard": read_json(run / "guard.json"), "bench": bench, "llamacpp": llama, "parity": parity(ev, bench), "k_choice": k_choices(ev, bench, llama)}
    doc["verdict"] = decide_run(doc)
    return redact(doc)  # every page and file is drawn from doc: a credential a stage recorded goes no further


def headline(doc: dict) -> str:
    """The one line that says how it went."""
    v, parts = doc["verdict"], []
    if doc.get("bench"):
        ups = [lv["speedup"] for lv in doc["bench"]["levels"] if lv["speedup"] is not None]
        sweep = doc["bench"].get("sweep")
        chosen = f" at k={doc['bench']['k']}, chosen from k={','.join(str(r['k']) for r in sweep['rows'])}" \
            if sweep and len(sweep["rows"]) > 1 else ""
        if ups:
            parts.append(f"vLLM speed-up {min(ups):.2f}x-{max(ups):.2f}x{chosen}")
    p = doc.get("parity")
    if p:
        ref = f" (reference decoder {p['reference_tau']:.2f})" if p["reference_tau"] is not None else ""
        parts.append(f"engine tau {p['engine_tau']:.2f}{ref} at k={p['k']}")
    elif doc.get("eval"):
        ev = doc["eval"]
        parts.append(f"reference tau {ev['tau']:.2f} at k={ev['k']}, speed-up {fmt(ev['speedup'])}x")
    llama = doc.get("llamacpp")
    if llama and llama["levels"][0]["speedup"] is not None:
        rows = (llama.get("sweep") or {}).get("rows") or []
        chosen = f", chosen from k={','.join(str(r['k']) for r in rows)}" if len(rows) > 1 else ""
        parts.append(f"llama.cpp speed-up {llama['levels'][0]['speedup']:.2f}x at k={llama['k']}{chosen} "
                     f"(batch 1, tau {fmt(llama['tau'])})")
    return f"verdict: {v['decision'].upper()} ({v['source']})" + (": " + "; ".join(parts) if parts else "")


# ---------------------------------------------------------------- the page


def kept_line(sel: dict) -> str:
    """What train.keep_start decided, from the drafter's config."""
    change = f"held-back simulated tau at k={sel['k']}: {sel['starting_tau']:.2f} before fine-tuning, {sel['fine_tuned_tau']:.2f} after"
    if sel["kept"] == "starting":
        return (f"**The run kept the starting drafter unchanged**: fine-tuning did not raise {change} "
                "(train.keep_start; train.keep_start=false keeps the fine-tuned one).")
    return f"The fine-tuned drafter is kept: {change}."


def blocks(doc: dict, images: list[str]) -> list[tuple]:
    """The page as a list of blocks: (h1|h2|p|list, text...), (table, header, rows), (img, file, alt)."""
    v = doc["verdict"]
    out: list[tuple] = [("h1", f"draftsmith run: {doc['target']}"), ("p", f"**{headline(doc)}**")]
    out += [("list", v["reasons"] + [f"next: {s}" for s in v.get("next_steps", [])])] if v["reasons"] else []
    d = doc.get("data")
    if d:
        unit = d["unit"]
        rows = [["conversations", d["conversations"]], ["assistant turns", d["assistant_turns"]],
                [f"assistant {unit}", d["assistant_" + unit]], [f"reasoning {unit}", d["reasoning_" + unit]],
                ["reasoning share", f"{d['reasoning_share']:.1%}"]]
        regen = d.get("regenerate") or {}
        if regen.get("first_turns"):
            ft = regen["first_turns"]
            rows += [["self-written first turns (sampled -> kept)", f"{ft['sampled']} -> {ft['kept']} (empty {ft['empty']}, "
                      f"cut off {ft['cut_off']}, repetitive {ft['repetitive']}, near-duplicate {ft['near_duplicate']}, "
                      f"eval overlap {ft['eval_overlap']})"], ["multi-turn conversations", regen.get("multi_turn")]]
        if d.get("store"):
            rows += [["captured tokens (store)", d["store"]["num_tokens"]],
                     ["supervised tokens (store)", d["store"]["num_supervised_tokens"]]]
        out += [("h2", "Data"), ("table", ["", "value"], rows)]
    tr = doc.get("training")
    if tr:
        out += [("h2", "Training"), ("p", f"Drafter {start_description(doc['config'])}.")]
        if doc.get("selection"):
            out.append(("p", kept_line(doc["selection"])))
        out.append(("p", f"{tr['steps']} optimizer steps, loss {tr['first_loss']:.3f} -> "
                    f"{tr['final_loss']:.3f}, per-step accuracy {fmt(tr['first_acc'])} -> {fmt(tr['final_acc'])}, "
                    + (f"{tr['useful_tokens_per_s']:,.0f} useful tokens/s on average (padding excluded; "
                       f"{tr['tokens_per_s']:,.0f} with it)." if tr.get("useful_tokens_per_s") is not None else
                       f"{tr['tokens_per_s']:,.0f} tokens/s on average.")))
        if tr["evals"]:
            e = tr["evals"][-1]
            out.append(("p", f"Held-back samples at step {e['step']}: accuracy {fmt(e['acc'])}, simulated tau "
                        + ", ".join(f"k={k}: {t:.2f}" for k, t in e["tau"].items()) + "."))
        out += [("img", n, "training curves") for n in images if n == PLOTS[0]]
    ev, p = doc.get("eval"), doc.get("parity")
    if ev or p:
        out.append(("h2", "Acceptance"))
    if ev:
        s = ev["settings"]
        out += [("p", f"Reference speculative decoder ({s.get('limit')} `{s.get('prompts')}` prompts, "
                      f"{s.get('max_new_tokens')} new tokens, greedy, batch 1); output identical to the target's: "
                      f"{ev['identical_to_target']}"
                      + (f" ({ev['divergence']['note']})." if ev.get("divergence") else ".")),
                ("table", ["k", "tau", "acceptance per position", "speed-up"],
                 [[r["k"], fmt(r["tau"]), fmt(r["per_position"]), f"{fmt(r['speedup'])}x"] for r in ev["sweep"]])]
    if p:
        out += [("p", f"Parity at k={p['k']}: engine tau **{p['engine_tau']:.2f}**, reference decoder "
                      f"**{fmt(p['reference_tau'])}** (difference {fmt(p['difference'], '+.2f')}; {p['note']})."),
                ("table", ["", "per-position acceptance"],
                 [["vLLM", fmt(p["engine_per_position"])], ["reference decoder", fmt(p["reference_per_position"])]])]
    out += [("img", n, "acceptance per position and tau against k") for n in images if n == PLOTS[1]]
    out += k_blocks(doc)
    b = doc.get("bench")
    if b:
        s = b["settings"]
        out += [("h2", "Throughput"),
                ("p", f"vLLM with and without the drafter (k={b['k']}), {s['num_prompts']} `{s['prompts']}` prompts per "
                      f"level{rounds_phrase(s['rounds'])}, {s['max_tokens']} tokens, temperature "
                      f"{s['temperature']}, {s['warmup']} warm-up request(s)."),
                ("table", ["level", "tok/s with drafter", "tok/s without", "speed-up", "tau", "TPOT p50 ms", "failed"],
                 [[f"c={lv['concurrency']}", fmt(lv["output_tokens_per_s"], ".1f"),
                   fmt(lv["baseline_output_tokens_per_s"], ".1f"), f"{fmt(lv['speedup'])}x", fmt(lv["tau"]),
                   fmt(lv["tpot_ms_p50"], ".1f"), lv["failed"]] for lv in b["levels"]])]
    elif doc.get("llamacpp"):
        out += [("h2", "Throughput"),
                ("p", "vLLM did not run (the Stages table says why); llama.cpp's numbers follow.")]
    elif ev:
        out += [("h2", "Throughput"), ("p", f"Reference decoder only (no engine run): {ev['tokens_per_s_spec']:.1f} "
                 f"tok/s with the drafter, {fmt(ev['tokens_per_s_base'], '.1f')} without ({fmt(ev['speedup'])}x).")]
    out += [("img", n, "throughput") for n in images if n == PLOTS[2]]
    out += llamacpp_blocks(doc)
    out += check_blocks(doc)
    sm = doc["summary"]
    failed = (sm.get("failed") or {}).get("stage")
    rows = [[st, "FAILED" if st == failed else "skipped: " + sm["skipped"][st] if st in (sm.get("skipped") or {})
             else (sm.get("stages") or {}).get(st, "-"), fmt((sm.get("stage_seconds") or {}).get(st), ".0f")]
            for st in ("regenerate", "capture", "train", "export", "eval", "check", "launch", "guard", "bench")]
    out += [("h2", "Stages"), ("table", ["stage", "this run", "seconds"], rows)]
    if doc.get("launch"):
        la = doc["launch"]
        out.append(("p", f"Launch: {la['status']}" + (f", ready after {la['ready_s']:.0f} s" if la.get("ready_s") else "")
                    + (f"; {la['error']}" if la.get("error") else "") + f" (log `{la['log']}`)."))
    if doc.get("guard"):
        out.append(("p", guard_line(doc["guard"])))
    return out


def guard_line(g: dict) -> str:
    """The acceptance guard's verdict on launch's server: per-position acceptance, the engine's against the
    drafter's expected, and the first candidate cause when it alarmed."""
    if g.get("state") == "not measured":
        return "Guard: not measured (no server of this invocation's launch stage)."
    m, e = g.get("measured") or {}, g.get("expected") or {}
    line = (f"Guard: **{g['state']}**: acceptance per position {fmt(m.get('per_position'))} over {m.get('drafts')} "
            f"drafts, expected {fmt(e.get('per_position')) if e else 'nothing recorded'}")
    if g.get("reasons"):
        line += f"; {g['reasons'][0]}"
    if g.get("causes"):
        line += f"; first candidate cause: {g['causes'][0]['cause']} (fix: {g['causes'][0]['fix']})"
    return line + f" ({fmt(g.get('seconds'), '.0f')} s)."


def k_blocks(doc: dict) -> list[tuple]:
    """Which k each engine used and why, then vLLM's sweep: one row per k, the reference decoder's tau beside."""
    choices = doc.get("k_choice") or []
    if not choices:
        return []
    out: list[tuple] = [("h2", "Draft length (k) per engine"),
                        ("list", [f"{c['engine']}: **k={c['k']}**, {c['why']}." for c in choices])]
    sweep = ((doc.get("bench") or {}).get("sweep") or {}).get("rows") or []
    if sweep:
        ref = {r["k"]: r["tau"] for r in (doc.get("eval") or {}).get("sweep", [])}
        chosen = doc["bench"]["k"]
        labels = [lv["level"] for lv in sweep[0]["levels"]]
        rows = [[f"**{r['k']}** (chosen)" if r["k"] == chosen else r["k"], fmt(r["tau"]), fmt(ref.get(r["k"])),
                 fmt(r["per_position"])]
                + [f"{fmt(lv['speedup'])}x ({fmt(lv['output_tokens_per_s'], '.1f')} / "
                   f"{fmt(lv['baseline_output_tokens_per_s'], '.1f')}{round_range(lv.get('rounds_speedup'))})"
                   for lv in r["levels"]] for r in sweep]
        out.append(("table", ["k", "vLLM tau", "reference tau", "vLLM acceptance per position"]
                    + [f"{label} speed-up (tok/s with / without; per round)" for label in labels], rows))
    return out


def llamacpp_blocks(doc: dict) -> list[tuple]:
    """llama.cpp's section: how it was measured, the k it serves and why, one row per k of its sweep."""
    llama = doc.get("llamacpp")
    if not llama:
        return []
    s, sweep = llama["settings"], llama["sweep"]
    rows = [[f"**{r['k']}** (chosen)" if r["k"] == llama["k"] else r["k"], fmt(r["tau"]), fmt(r["per_position"]),
             f"{fmt(lv['speedup'])}x", fmt(lv["output_tokens_per_s"], ".1f"),
             fmt(lv["baseline_output_tokens_per_s"], ".1f"), fmt(lv["rounds_speedup"]), r["failed"]]
            for r in sweep["rows"] for lv in r["levels"]]
    return [("h2", "llama.cpp"),
            ("p", f"`llama-server` with and without the drafter (`{Path(llama['drafter_gguf']).name}` on "
                  f"`{Path(llama['target_gguf']).name}`), batch 1, each draft ending at the first token the drafter "
                  f"gives less than p-min {llama['p_min']:g}; {s['num_prompts']} `{s['prompts']}` prompts"
                  f"{rounds_phrase(s['rounds'])}, {s['max_tokens']} tokens, temperature {s['temperature']}, "
                  f"{s['warmup']} warm-up request(s). **k={llama['k']}**: {sweep['choice']['reason']}. Its tau counts "
                  "those shortened drafts: not the reference decoder's tau at k."),
            ("table", ["k", "llama.cpp tau", "acceptance per position", "speed-up", "tok/s with drafter",
                       "tok/s without", "speed-up per round", "failed"], rows)]


def round_range(speedups: list[float] | None) -> str:
    """`; rounds 1.52-1.66x`: the spread of a level's per-round speed-ups, how far the machine moved."""
    return f"; rounds {min(speedups):.2f}-{max(speedups):.2f}x" if speedups and len(speedups) > 1 else ""


def rounds_phrase(n: int) -> str:
    return f" in {n} rounds alternating with the baseline" if n > 1 else ""


def check_blocks(doc: dict) -> list[tuple]:
    check = doc.get("check")
    if not check:
        return []
    out: list[tuple] = [("h2", "Check")]
    for engine, c in check.items():
        out.append(("p", f"{engine} {c['engine_version']}: {c['verdict']}"))
        rows = [[f["severity"], f["rule"], f["message"], f["fix"]] for f in c["findings"] if f["severity"] != "ok"]
        if rows:
            out.append(("table", ["severity", "rule", "finding", "fix"], rows))
    return out


def render_markdown(page: list[tuple]) -> str:
    lines: list[str] = []
    for kind, *rest in page:
        if kind == "h1":
            lines += [f"# {rest[0]}", ""]
        elif kind == "h2":
            lines += [f"## {rest[0]}", ""]
        elif kind == "p":
            lines += [rest[0], ""]
        elif kind == "list":
            lines += [f"- {item}" for item in rest[0]] + [""]
        elif kind == "img":
            lines += [f"![{rest[1]}]({rest[0]})", ""]
        elif kind == "table":
            header, rows = rest
            cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines += ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows] + [""]
    return "\n".join(lines)


def inline(text: str) -> str:
    """Markdown's **bold** and `code` in an HTML-escaped string."""
    import re

    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def render_html(page: list[tuple], image_dir: Path) -> str:
    """The same page as one self-contained HTML file (plots embedded as data URIs)."""
    body: list[str] = []
    for kind, *rest in page:
        if kind in ("h1", "h2", "p"):
            body.append(f"<{kind}>{inline(rest[0])}</{kind}>")
        elif kind == "list":
            body.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in rest[0]) + "</ul>")
        elif kind == "img":
            data = base64.b64encode((image_dir / rest[0]).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(rest[1])}" src="data:image/png;base64,{data}">')
        elif kind == "table":
            header, rows = rest
            body.append("<table><tr>" + "".join(f"<th>{inline(str(h))}</th>" for h in header) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{inline(str(c))}</td>" for c in r) + "</tr>" for r in rows)
                        + "</table>")
    style = ("body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:left;font-size:14px}img{max-width:100%}code{background:#f3f3f3;padding:0 3px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draftsmith report</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run: Path) -> Path:
    """report.json, report.md (+ PNGs) and report.html in the run directory; returns report.md's path."""
    run = Path(run)
    doc = collect(run)
    images = plot_all(doc, run)
    page = blocks(doc, images)
    (run / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (run / "report.md").write_text(render_markdown(page))
    (run / "report.html").write_text(render_html(page, run))
    return run / "report.md"


class ReportSettings(Settings):
    """Which run `report` renders and how it answers: the report verb's command line."""

    run_dir: Path
    """A directory written by `draftsmith run`."""
    as_json: bool = False
    """Print report.json on stdout."""


def add_parser(sub) -> None:
    from draftsmith.config import example_help

    p = sub.add_parser("report", help="re-render a run directory's one-page report (markdown, HTML, JSON)",
                       **example_help("example:\n  draftsmith report runs/demo   # writes report.md, report.html, "
                                      "report.json and report-*.png there"))
    add_flags(p, ReportSettings, positional=("run_dir",), flags=JSON_FLAG)
    p.set_defaults(func=run_report)


def run_report(args) -> int:
    s = from_flags(ReportSettings, args)
    path = write_report(s.run_dir)
    doc = json.loads((s.run_dir / "report.json").read_text())
    print(json.dumps(doc, indent=2) if s.as_json else f"{headline(doc)}\nreport -> {path} (and report.html, report.json)")
    return 0
