"""What a misread of the aux layer ids costs, in a real vLLM, with a drafter that accepts.

One trained drafter is exported for vLLM, then served three ways from the same weights:
- `as-exported`: explicit boundary ids (what draftsmith writes);
- `ids-absent`: no ids in config.json (vLLM falls back to its default (2, N//2, N-3));
- `sglang-ids`: the ids of an SGLang export ([1, 14, 26], SGLang adds 1 when it reads them) served on vLLM,
  which reads them as given: every aux state comes from one layer too early.
For each, `draftsmith check` predicts (from the files only) and vLLM measures tau on the same prompts.
Starts engines: run it under the shared lock.

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/experiments/aux_misread.py --drafter DRAFTER --k 4

Writes benchmarks/results/aux_misread.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))
from llamacpp_parity import metrics_text, vllm_tokens, window  # noqa: E402  the shared request and /metrics helpers

OUT = BENCHMARKS / "results" / "aux_misread.json"
VARIANTS = {"as-exported": None, "ids-absent": "absent", "sglang-ids": [1, 14, 26]}


def variant(src: Path, dst: Path, ids) -> Path:
    """A copy of the vLLM export whose config names other aux ids (or none); weights shared by link."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    eagle = dict(config.get("eagle_config") or {})
    if ids == "absent":
        eagle.pop("eagle_aux_hidden_state_layer_ids", None)
    elif ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
    config["eagle_config"] = eagle
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, required=True, help="draftsmith checkpoint directory")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.preflight.check import CheckSettings, run_checks
    from draftsmith.engines.process import VllmServe, serve
    from draftsmith.export.formats import export
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target
    from transformers import AutoTokenizer

    target = resolve_target("smollm2")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts("eval", args.prompts)]
    result = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "drafter": str(args.drafter), "k": args.k, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "variants": {}}
    spec = json.dumps({"method": "eagle3", "num_speculative_tokens": args.k})
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        export(args.drafter, tmp / "vllm", "vllm", "float32", args.k, str(target))
        for name, ids in VARIANTS.items():
            drafter = variant(tmp / "vllm", tmp / name / "drafter-eagle3", ids)
            findings, _ = run_checks(target, drafter, CheckSettings(
                engine="vllm",
                engine_version="0.33.0",
                speculative_config=json.dumps({**json.loads(spec), "model": str(drafter)}),
                engine_args="--dtype float32",
            ))
            row = {"aux_ids_in_config": ids if ids is not None else "as exported",
                   "check": [{"severity": f.severity, "rule": f.rule, "message": f.message} for f in findings
                             if f.severity != "ok"]}
            vspec = VllmServe(target=target, drafter=drafter, num_speculative_tokens=args.k, max_model_len=1024)
            with serve(vspec, tmp / f"{name}.log", timeout_s=900) as base:
                vllm_tokens(base, prompts[0], 8)  # warm-up, outside the window
                before = metrics_text(base)
                for ids_ in prompts:
                    vllm_tokens(base, ids_, args.max_tokens)
                after = metrics_text(base)
            row["vllm"] = window(before, after)
            result["variants"][name] = row
            errors = [c["rule"] for c in row["check"] if c["severity"] == "error"]
            print(f"{name}: vLLM tau {row['vllm']['tau']:.3f} | check errors: {errors or 'none'}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
