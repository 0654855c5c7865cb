"""The package's import picture: modules, edges, cycles, layers, and imports that point up the stage order.

Reads `src/draftsmith` as text (ast), imports nothing from it. Run: `python scripts/import_layers.py [--json]`.
A module's layer is the length of the longest chain of imports below it (a module importing nothing is layer 0);
modules in a cycle share one layer. Imports inside functions count as imports.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "draftsmith"
PKG = "draftsmith"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (`from . import x`, `from draftsmith.a import b`, `import draftsmith.a`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            candidates = bases
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for cand in candidates:
            while cand and cand not in modules:
                cand = cand.rpartition(".")[0]
            if cand and cand != name and cand != PKG:
                found.add(cand)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; returns the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def layers(g: dict[str, set[str]]) -> dict[str, int]:
    comp_of = {m: m for m in g}
    for comp in strongly_connected(g):
        for m in comp:
            comp_of[m] = comp[0]
    dag: dict[str, set[str]] = defaultdict(set)
    for m, deps in g.items():
        for d in deps:
            if comp_of[d] != comp_of[m]:
                dag[comp_of[m]].add(comp_of[d])
    memo: dict[str, int] = {}

    def depth(c: str) -> int:
        if c not in memo:
            memo[c] = 1 + max((depth(d) for d in dag[c]), default=-1)
        return memo[c]

    return {m: depth(comp_of[m]) for m in g}


def stage_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "(ground)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the text picture")
    args = ap.parse_args()
    g = graph()
    lay = layers(g)
    cycles = strongly_connected(g)
    stage_edges: dict[tuple[str, str], int] = defaultdict(int)
    for m, deps in g.items():
        for d in deps:
            if stage_of(m) != stage_of(d):
                stage_edges[(stage_of(m), stage_of(d))] += 1
    stage_graph = {s: {b for (a, b) in stage_edges if a == s} for s in {stage_of(m) for m in g}}
    stage_cycles = strongly_connected(stage_graph)
    summary = {
        "modules": len(g),
        "edges": sum(len(d) for d in g.values()),
        "module_layers": 1 + max(lay.values()),
        "cycles": cycles,
        "package_cycles": stage_cycles,
        "package_layers": 1 + max(layers(stage_graph).values()),
        "largest": sorted(((sum(1 for _ in open(ROOT.parent / (m.replace(".", "/") + ".py"))) if (ROOT.parent / (m.replace(".", "/") + ".py")).exists() else 0, m) for m in g), reverse=True)[:10],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"modules {summary['modules']}, import edges {summary['edges']}, layers {summary['module_layers']}")
    print(f"module cycles: {cycles or 'none'}")
    print(f"package cycles: {stage_cycles or 'none'}; package layers {summary['package_layers']} "
          "(the ground floor's modules count as one package)")
    by_layer: dict[int, list[str]] = defaultdict(list)
    for m, n in lay.items():
        by_layer[n].append(m.removeprefix(PKG + "."))
    for n in sorted(by_layer, reverse=True):
        print(f"  layer {n:2d}: {' '.join(sorted(by_layer[n]))}")


if __name__ == "__main__":
    main()
