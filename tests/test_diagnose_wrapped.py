"""A wrapper's line prefix (a supervisor's, docker compose's, kubectl's timestamps, the systemd journal's) is
learned from the log itself and stripped: every development-half corpus log and every fixture log, wrapped by
tests/logwrap.py, gets the root cause of its plain self."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftsmith.engines.diagnose import analyze, analyze_file, read_log
from draftsmith.engines.loglines import learn_prefix, split_line
from logwrap import WRAPPERS, answer, wrap

TESTS = Path(__file__).parent
CORPUS = TESTS / "fixtures" / "diagnose_corpus"
DEV = [(CORPUS / c["file"]) for c in json.loads((CORPUS / "index.json").read_text())["cases"] if c["split"] == "dev"]
DEV += [(CORPUS / "set2" / c["file"]) for c in json.loads((CORPUS / "set2" / "index.json").read_text())["cases"]
        if c["split"] == "dev"]
FIXTURE_LOGS = sorted((TESTS / "fixtures" / "logs").glob("*.log"))


def _same_cause(plain: tuple, wrapped: tuple) -> None:
    """Line, kind and hint equal; the text is the plain one (a log with no engine line form anywhere keeps
    its prefix in the text: nothing tells the wrapper from the message there)."""
    assert wrapped[0] == plain[0] and wrapped[1] == plain[1] and wrapped[3] == plain[3], (plain, wrapped)
    assert (wrapped[2] or "").endswith(plain[2] or ""), (plain[2], wrapped[2])


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("log", DEV + FIXTURE_LOGS, ids=[p.stem for p in DEV + FIXTURE_LOGS])
def test_a_wrapped_log_gets_the_root_cause_of_the_plain_one(log, wrapper):
    plain = read_log(log)
    _same_cause(answer(plain), answer(wrap(plain, wrapper)))
    before, after = analyze(plain), analyze(wrap(plain, wrapper))
    assert (after.phase, after.ready, after.exceptions) == (before.phase, before.ready, before.exceptions)


def test_the_dev_half_has_both_engines_and_every_kind():
    assert len(DEV) >= 40
    kinds = {answer(read_log(p))[1] for p in DEV}
    assert {"exception", "error_line", "hang", "not_captured", "stalled"} <= kinds


@pytest.mark.parametrize("log", DEV + FIXTURE_LOGS, ids=[p.stem for p in DEV + FIXTURE_LOGS])
def test_a_plain_log_has_no_wrapper_prefix_or_the_collector_prefix_it_carries(log):
    """A plain log learns nothing, except the collector prefix a poster's log already had (a container stamp,
    compose's `name-1  | `), which is then stripped as before."""
    prefix = learn_prefix(read_log(log))
    if prefix is not None:
        for raw in read_log(log):
            if m := prefix.match(raw):
                assert re.match(r"\d{4}-\d\d-\d\dT|[\w.-]+-\d+ +\| |\[\d{4}-|\S+ \S+ \d+ [\d:]+ ", m.group()), m.group()


def _whitelist_log(with_process: bool) -> list[str]:
    """vLLM's EAGLE-3 whitelist refusal (speculative.py: `Eagle3 is only supported for {models} models. Got
    {model_type=}`) in the pydantic form of a real development-half log, with or without vLLM's process prefix."""
    lines = read_log(CORPUS / "vllm_omni_gh2170_pydantic_architectures.log")
    out = []
    for raw in lines:
        raw = raw.replace("No model architectures are specified",
                          "Eagle3 is only supported for ['llama', 'qwen', 'minicpm', 'gpt_oss'] models. "
                          "Got self.target_model_config.hf_text_config.model_type='gemma3'")
        out.append(raw.replace("ModelConfig", "SpeculativeConfig"))
    return out if with_process else [re.sub(r"^\(APIServer pid=\d+\) ", "", raw) for raw in out]


@pytest.mark.parametrize("with_process", [True, False], ids=["vllm-prefix", "bare"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_the_eagle3_whitelist_error_is_named_under_every_wrapper(tmp_path, wrapper, with_process):
    plain = _whitelist_log(with_process)
    assert answer(plain)[3] == "eagle3_whitelist"
    log = tmp_path / "engine.log"
    log.write_text("\n".join(wrap(plain, wrapper)))
    rc = analyze_file(log).root_cause  # the streamed reader learns the prefix from the file's head
    assert (rc.line, rc.kind, rc.hint_name) == answer(plain)[0:2] + ("eagle3_whitelist",)
    assert rc.text.startswith("pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig")
    assert any("Eagle3 is only supported for" in d for d in rc.detail)


def test_prefix_pieces_that_vary_line_to_line_are_one_shape():
    """stdout and stderr, pids, clocks and a padded compose column vary; the learned prefix covers them all."""
    lines = ["INFO PyProcess W-17-stdout: INFO 12-07 12:00:01 [api_server.py:1] vLLM API server version 0.9.2",
             "INFO PyProcess W-17-stderr: Traceback (most recent call last):",
             'INFO PyProcess W-17-stderr:   File "/v/vllm/config.py", line 3, in __init__',
             "INFO PyProcess W-17-stderr:     raise ValueError(msg)",
             "INFO PyProcess W-17-stderr: ValueError: Eagle3 is only supported for ['llama'] models."]
    prefix = learn_prefix(lines)
    assert [split_line(raw, prefix).text for raw in lines[2:]] == [
        '  File "/v/vllm/config.py", line 3, in __init__', "    raise ValueError(msg)",
        "ValueError: Eagle3 is only supported for ['llama'] models."]
    rc = analyze(lines).root_cause
    assert (rc.line, rc.exception_type, rc.hint_name) == (5, "ValueError", "eagle3_whitelist")
    compose = ["router      | INFO 12-07 12:00:01 [x.py:1] Starting vLLM API server",
               "vllm-main-1 | Traceback (most recent call last):",
               'vllm-main-1 |   File "/v/vllm/config.py", line 3, in __init__',
               "vllm-main-1 | ValueError: bad"]
    assert analyze(compose).root_cause.text == "ValueError: bad"


def test_a_journal_stamp_and_a_kubectl_stamp_are_the_stall_clock():
    """The wrapper's ISO stamp still times a stall (kubectl); a line without one keeps its engine's own stamp."""
    lines = ["2026-12-07T12:00:01.000000001Z INFO 12-07 12:00:01 [loader.py:1] Starting to load model m...",
             "2026-12-07T12:00:02.5Z Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01, 1.0s/it]",
             "2026-12-07T12:09:02.5Z some other line"]
    stall = analyze(lines).stall
    assert stall is not None and stall.line == 2 and stall.silence_s == 540.0
