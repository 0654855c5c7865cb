"""tau of one drafter in llama.cpp, vLLM and `draftsmith eval`, on the same prompts, k and length.

All three decode greedily in fp32 (f32 GGUFs for llama.cpp) from the same prompt token ids (the target's
chat template applied by draftsmith, sent as ids to llama-server `/completion` and vLLM `/v1/completions`),
so the three see identical inputs. Engine counters are differenced around the measured requests.
Starts engines: run it under the shared lock.

    flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_parity.py \
        --drafter runs/demo/train/drafter --k 3 --prompts 4 --max-tokens 48

Writes benchmarks/results/llamacpp_parity.json (and, with --save-metrics DIR, llama-server's raw
/metrics text before and after the requests and vLLM's log). A drafter the llamacpp export refuses (a norm
variant llama.cpp does not compute) gets the refusal under "llamacpp"; vLLM and eval still run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from draftsmith.engines import llamacpp
from draftsmith.errors import DraftsmithError
from draftsmith.bench.metrics import acceptance_from_counters, parse_spec_counters

OUT = Path(__file__).parent / "results" / "llamacpp_parity.json"


def metrics_text(base: str) -> str:
    return urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()


def window(before: str, after: str) -> dict:
    (source, b), (_, a) = parse_spec_counters(before), parse_spec_counters(after)
    acc = acceptance_from_counters(a.minus(b), source)
    return {"tau": acc.tau, "per_position": list(acc.per_position), "drafts": acc.drafts, "accepted": acc.accepted,
            "draft_tokens": acc.draft_tokens}


def vllm_tokens(base: str, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy `/v1/completions` from token ids; vLLM returns text, so tokens are re-encoded by the caller."""
    body = {"model": "target", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def run_llamacpp(args, target: Path, tok, prompts: list[list[int]], tmp: Path) -> dict:
    """llama.cpp's tau (and a short `draftsmith bench` window) for the drafter, exported f32 into `tmp`.

    Raises:
        DraftsmithError: the llamacpp export refuses the drafter (a norm variant llama.cpp does not compute).
    """
    from draftsmith.export.formats import export

    gguf = export(args.drafter, tmp / "llamacpp", "llamacpp", "float32", args.k, str(target))
    manifest = json.loads((gguf / "llamacpp.json").read_text())
    with llamacpp.serve(llamacpp.LlamaServe(Path(manifest["target_gguf"])), tmp / "plain.log") as base:
        plain = [llamacpp.complete(base, ids, args.max_tokens) for ids in prompts]
    spec = llamacpp.LlamaServe(Path(manifest["target_gguf"]), gguf / manifest["drafter_gguf"], k=args.k,
                               p_min=0.0)  # k-token drafts: tau comparable with draftsmith eval
    with llamacpp.serve(spec, tmp / "llama.log") as base:
        before = metrics_text(base)
        done = [llamacpp.complete(base, ids, args.max_tokens) for ids in prompts]
        time.sleep(0.5)
        after = metrics_text(base)
        bench = subprocess.run([sys.executable, "-m", "draftsmith.cli", "bench", "--endpoint", base, "--num-prompts",
                                "2", "--concurrency", "1", "--max-tokens", "32", "--warmup", "0", "--json"],
                               capture_output=True, text=True)
    log = (tmp / "llama.log").read_text(errors="replace")
    out: dict = {"llamacpp": window(before, after) | {
        "timings_draft_n": sum(c.timings.draft_n for c in done), "timings_draft_n_accepted": sum(c.timings.draft_n_accepted for c in done),
        "tokens_equal_to_llamacpp_without_drafter": [c.tokens == p.tokens for c, p in zip(done, plain)],
        "extract_layers_line": next((ln.strip() for ln in log.splitlines() if "extract_layers =" in ln), None),
        "texts": [tok.decode(c.tokens, skip_special_tokens=True) for c in done]}}
    try:
        out["bench_acceptance"] = json.loads(bench.stdout)["acceptance"]
    except (json.JSONDecodeError, KeyError):
        out["bench_acceptance"] = {"error": bench.stderr[-1500:]}
    if args.save_metrics:
        args.save_metrics.mkdir(parents=True, exist_ok=True)
        (args.save_metrics / "llamacpp_spec_before.prom").write_text(before)
        (args.save_metrics / "llamacpp_spec_after.prom").write_text(after)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="draftsmith checkpoint directory or shipped short name (smollm2)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="how many prompts of --prompt-set")
    ap.add_argument("--prompt-set", default="eval", help="eval (HumanEval) | chat-eval | a JSONL prompt file")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-eval", action="store_true", help="engines only (eval takes minutes on a loaded CPU)")
    ap.add_argument("--save-metrics", type=Path, default=None, help="directory for llama-server's /metrics text and vLLM's log")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from draftsmith.model.checkpoint import drafter_path

    args.drafter = drafter_path(args.drafter)

    from transformers import AutoTokenizer

    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.engines.process import VllmServe
    from draftsmith.engines.process import serve as serve_vllm
    from draftsmith.eval.evaluation import run_eval
    from draftsmith.export.formats import export
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts(args.prompt_set, args.prompts)]
    result: dict = {"drafter": str(args.drafter), "k": args.k, "prompts": args.prompts, "prompt_set": args.prompt_set, "max_tokens": args.max_tokens,
                    "dtype": "float32", "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": "flock /tmp/draftsmith-engine.lock .venv/bin/python benchmarks/llamacpp_parity.py "
                               + " ".join(sys.argv[1:])}
    if not args.skip_eval:
        [ours] = run_eval("smollm2", args.drafter, args.prompt_set, [args.k], args.prompts, 0.0, args.max_tokens, "vllm",
                          "float32", True, 0)
        result["eval"] = {"tau": ours.tau, "per_position": ours.per_position, "verify_steps": ours.verify_steps,
                          "identical_to_target": ours.identical_to_target}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            result |= run_llamacpp(args, target, tok, prompts, tmp)
        except DraftsmithError as e:  # a drafter llama.cpp cannot serve faithfully (export refuses): vLLM and eval still run
            result["llamacpp"] = {"refused": str(e)}
        if not args.skip_vllm:
            export(args.drafter, tmp / "vllm", "vllm", "float32", args.k, str(target))
            vspec = VllmServe(target=target, drafter=tmp / "vllm", num_speculative_tokens=args.k, max_model_len=1024)
            with serve_vllm(vspec, tmp / "vllm.log", timeout_s=900) as base:
                before = metrics_text(base)
                texts = [vllm_tokens(base, ids, args.max_tokens) for ids in prompts]
                time.sleep(1.0)
                after = metrics_text(base)
            result["vllm"] = window(before, after) | {"texts": texts}
            if args.save_metrics:
                args.save_metrics.mkdir(parents=True, exist_ok=True)
                (args.save_metrics / "vllm.log").write_text((tmp / "vllm.log").read_text(errors="replace"))
            if "texts" in result["llamacpp"]:
                result["texts_equal_llamacpp_vllm"] = [a.strip() == b.strip() for a, b in
                                                       zip(result["llamacpp"]["texts"], texts)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    row = " | ".join(f"{name} {result[name]['tau']:.3f}" for name in ("eval", "llamacpp", "vllm")
                    if "tau" in result.get(name, {}))
    print(f"tau (k={args.k}, {args.prompts} prompts, {args.max_tokens} tokens): {row}")


if __name__ == "__main__":
    main()
