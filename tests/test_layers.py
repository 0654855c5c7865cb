"""The layers contract in pyproject.toml (import-linter) holds for the tree and catches an import that points up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def lint(src: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT), "--no-cache", str(config)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def contract_copy(tmp_path: Path) -> tuple[Path, Path]:
    """The package and the pyproject's contracts, copied where an edit cannot touch the real tree."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "draftsmith", src / "draftsmith", ignore=shutil.ignore_patterns("__pycache__", "data"))
    config = tmp_path / ".importlinter.toml"
    shutil.copyfile(ROOT / "pyproject.toml", config)
    return src, config


def test_the_tree_keeps_the_layers_contract(tmp_path):
    src, config = contract_copy(tmp_path)
    r = lint(src, config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout


def test_an_import_pointing_up_breaks_the_contract(tmp_path):
    src, config = contract_copy(tmp_path)
    model = src / "draftsmith" / "model" / "eagle3.py"
    model.write_text(model.read_text() + "\nfrom draftsmith.run import stages  # wrong on purpose: model is below run\n")
    r = lint(src, config)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and "draftsmith.model.eagle3 -> draftsmith.run.stages" in r.stdout, r.stdout


def test_an_import_between_independent_siblings_breaks_the_contract(tmp_path):
    src, config = contract_copy(tmp_path)
    bench = src / "draftsmith" / "bench" / "metrics.py"
    bench.write_text(bench.read_text() + "\nfrom draftsmith.eval import tree  # wrong on purpose: bench and eval are siblings\n")
    r = lint(src, config)
    assert r.returncode != 0, r.stdout
    assert "draftsmith.bench.metrics -> draftsmith.eval.tree" in r.stdout, r.stdout


def test_a_module_outside_every_layer_breaks_the_contract(tmp_path):
    src, config = contract_copy(tmp_path)
    (src / "draftsmith" / "stray.py").write_text('"""A module placed in no layer."""\n')
    r = lint(src, config)
    assert r.returncode != 0, r.stdout
    assert "draftsmith.stray" in r.stdout, r.stdout


def test_every_stage_package_is_in_the_contract():
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    packages = {p.name for p in (ROOT / "src" / "draftsmith").iterdir() if (p / "__init__.py").exists()}
    assert packages <= named, f"stage packages missing from the layers contract: {sorted(packages - named)}"
