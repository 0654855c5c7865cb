"""The run report's plots: training curves, acceptance per position and tau against k, throughput with and
without the drafter; each drawn from the report's JSON document (report.collect) only when it has the data.

`plot_all` writes them as PLOTS into the run directory, where report.md links them and report.html embeds them.
"""

from __future__ import annotations

from pathlib import Path

PLOTS = ("report-training.png", "report-acceptance.png", "report-throughput.png")


def plot_all(doc: dict, out: Path) -> list[str]:
    """The PNGs the page shows (only those with data), written into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, draw in zip(PLOTS, (draw_training, draw_acceptance, draw_throughput)):
        fig = draw(doc, plt)
        (out / name).unlink(missing_ok=True)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def draw_training(doc: dict, plt):
    tr = doc.get("training")
    if not tr:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.plot(tr["step"], tr["loss"], color="#3b7dd8")
    a.set(xlabel="optimizer step", ylabel="TTT loss", title="training loss")
    for i in range(len(tr["acc"][0])):
        b.plot(tr["step"], [acc[i] for acc in tr["acc"]], label=f"TTT step {i + 1}")
    for e in tr["evals"]:
        b.scatter([e["step"]] * len(e["acc"]), e["acc"], marker="x", color="black", zorder=3)
    b.set(xlabel="optimizer step", ylabel="accuracy vs target argmax", ylim=(0, 1),
          title="per-step accuracy (x: held-back samples)")
    b.legend(fontsize=7)
    return fig


def draw_acceptance(doc: dict, plt):
    ev, bench, sim, llama = doc.get("eval"), doc.get("bench"), doc.get("simulated_tau"), doc.get("llamacpp")
    if not ev and not bench and not sim and not llama:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    bars = [(label, engine["per_position"]) for label, engine in (
        (f"reference decoder (k={(ev or {}).get('k')})", ev), (f"vLLM (k={(bench or {}).get('k')})", bench),
        (f"llama.cpp (k={(llama or {}).get('k')}, p-min {(llama or {}).get('p_min')})", llama))
        if engine and engine["per_position"]]
    width = 0.8 / max(len(bars), 1)  # the engines side by side at each position
    for i, (label, per_position) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        a.bar([x + offset for x in range(1, len(per_position) + 1)], per_position, width, label=label)
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set(xlabel="draft position", ylabel="accepted / verification steps", ylim=(0, 1),
          title="acceptance per position")
    if bars:
        a.legend(fontsize=7)
    if sim:
        ks = sorted(int(k) for k in sim)
        b.plot(ks, [sim[str(k)] if str(k) in sim else sim[k] for k in ks], "o--", label="simulated (training)")
    if ev:
        b.plot([r["k"] for r in ev["sweep"]], [r["tau"] for r in ev["sweep"]], "s-", label="reference decoder")
    rows = [r for r in ((bench or {}).get("sweep") or {}).get("rows", []) if r["tau"] is not None]
    if len(rows) > 1:
        b.plot([r["k"] for r in rows], [r["tau"] for r in rows], "D-", label="vLLM")
    if bench and bench["tau"] is not None:
        b.plot([bench["k"]], [bench["tau"]], "D", markersize=9, label="vLLM" if len(rows) < 2 else "vLLM, chosen k")
    llama_rows = [r for r in ((llama or {}).get("sweep") or {}).get("rows", []) if r["tau"] is not None]
    if llama_rows:
        b.plot([r["k"] for r in llama_rows], [r["tau"] for r in llama_rows], "^-",
               label=f"llama.cpp (p-min {llama['p_min']:g})")
    b.set(xlabel="k (drafted tokens)", ylabel="tau (tokens per target step)", title="tau against k")
    b.legend(fontsize=7)
    return fig


def draw_throughput(doc: dict, plt):
    ev = doc.get("eval")
    measured = [(name, doc[key]) for name, key in (("vLLM", "bench"), ("llama.cpp", "llamacpp")) if doc.get(key)]
    if measured:
        levels = [(name, lv) for name, engine in measured for lv in engine["levels"]]
        labels = [f"{name} c={lv['concurrency']}" for name, lv in levels]
        spec = [lv["output_tokens_per_s"] for _, lv in levels]
        base = [lv["baseline_output_tokens_per_s"] or 0 for _, lv in levels]
        title = " and ".join(name for name, _ in measured) + " output tokens/s"
    elif ev:
        labels, spec, base = ["batch 1"], [ev["tokens_per_s_spec"]], [ev["tokens_per_s_base"] or 0]
        title = "reference decoder tokens/s"
    else:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="without speculation")
    bars = ax.bar([x + 0.2 for x in xs], spec, 0.4, label="with the drafter")
    ax.bar_label(bars, labels=[f"{s / b:.2f}x" if b else "" for s, b in zip(spec, base)])
    ax.set_xticks(list(xs), labels)
    ax.set(ylabel="output tokens/s", title=title)
    ax.legend(fontsize=7)
    return fig
