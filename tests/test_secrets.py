"""No credential is written or printed: `client.redact` on each form, then every input that can carry one.

A distinct secret is planted in each input that can hold a credential (regenerate's --endpoint, bench's
--endpoint and --baseline-endpoint, a run config's regenerate.endpoints, capture.endpoint and
bench.baseline_endpoint, launch's engine command line, and the API-key environment variable), the verbs run
against small OpenAI-compatible servers on 127.0.0.1 (`StubServer`), and every file under tmp_path and
everything printed is searched for every secret. The stubs record what each request carried, so the tests also
show that the real requests keep their credentials.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from draftsmith.cli import main
from draftsmith.client import REDACTED, redact
from draftsmith.engines.process import free_port

ENV_KEY = "envkey-SECRET-0e1f2a3b"  # $DRAFTSMITH_API_KEY
MODEL = "stub-model"


class StubServer:
    """An OpenAI-compatible server on 127.0.0.1: `/v1/models`, chat completions (plain and streamed, with
    usage), raw completions, `/health` and an empty `/metrics`. `seen` holds (path with query, Authorization)
    of every request."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: the tests read what draftsmith prints
                pass

            def reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stub.seen.append((self.path, self.headers.get("Authorization", "")))
                path = urlsplit(self.path).path
                if path == "/v1/models":
                    return self.reply(200, json.dumps({"object": "list", "data": [
                        {"id": MODEL, "object": "model", "created": 0, "owned_by": "stub"}]}).encode())
                if path in ("/health", "/metrics"):
                    return self.reply(200, b"", "text/plain")
                self.reply(404, b"{}")

            def do_POST(self):
                stub.seen.append((self.path, self.headers.get("Authorization", "")))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                path = urlsplit(self.path).path
                head = {"id": "x", "created": 0, "model": MODEL}
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                if path == "/v1/completions":
                    return self.reply(200, json.dumps({**head, "object": "text_completion", "usage": usage,
                                                       "choices": [{"index": 0, "text": " two words",
                                                                    "finish_reason": "stop"}]}).encode())
                if path != "/v1/chat/completions":
                    return self.reply(404, b"{}")
                if not body.get("stream"):
                    return self.reply(200, json.dumps({**head, "object": "chat.completion", "usage": usage, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "an answer"},
                         "finish_reason": "stop"}]}).encode())
                chunk = {**head, "object": "chat.completion.chunk"}
                events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "an"},
                                                 "finish_reason": None}]},
                          {**chunk, "choices": [{"index": 0, "delta": {"content": " answer"}, "finish_reason": "stop"}]},
                          {**chunk, "choices": [], "usage": usage}]
                self.reply(200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                           + b"data: [DONE]\n\n", "text/event-stream")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url(self, userinfo: str = "", path: str = "/v1", query: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}{path}{'?' + query if query else ''}"

    def basic(self, user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    s = StubServer()
    yield s
    s.stop()


@pytest.fixture
def stub2():
    s = StubServer()
    yield s
    s.stop()


@pytest.fixture
def env_key(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_API_KEY", ENV_KEY)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    return ENV_KEY


def leaks(secrets: list[str], root: Path, *printed: str) -> list[str]:
    """Every (secret, where) found: in any file under `root` (binary files too) or in the printed text."""
    found = [(s, "printed") for s in secrets for text in printed if s in text]
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [(s, str(path)) for s in secrets if s.encode() in data]
    return [f"{s} in {where}" for s, where in found]


def write_prompts(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))
    return path


# ---------------------------------------------------------------- redact, form by form


@pytest.mark.parametrize("text, secret, shown", [
    ("http://user:pw-SECRET@h:8000/v1", "pw-SECRET", "http://***@h:8000/v1"),
    ("http://user-SECRET:pw-SECRET@h:8000/v1", "user-SECRET", "http://***@h:8000/v1"),
    ("https://tok-SECRET@h/v1", "tok-SECRET", "https://***@h/v1"),
    ("http://u:p@ss-SECRET@h:1/v1?x=1", "ss-SECRET", "http://***@h:1/v1?x=1"),
    ("http://h/v1?api_key=q-SECRET&model=a", "q-SECRET", "http://h/v1?api_key=***&model=a"),
    ("http://h/v1?a=1&key=q-SECRET#16", "q-SECRET", "http://h/v1?a=1&key=***#16"),
    ("http://h/v1?Access_Token=q-SECRET", "q-SECRET", "http://h/v1?Access_Token=***"),
    ('curl -H "Authorization: Bearer b-SECRET" x', "b-SECRET", 'curl -H "Authorization: Bearer ***" x'),
    ("{'Authorization': 'Bearer b-SECRET'}", "b-SECRET", "{'Authorization': 'Bearer ***'}"),
    ("Authorization: Basic dXNlcjpwdw==", "dXNlcjpwdw==", "Authorization: Basic ***"),
    ("x-api-key: h-SECRET", "h-SECRET", "x-api-key: ***"),
    ("vllm serve m --api-key f-SECRET --port 1", "f-SECRET", "vllm serve m --api-key *** --port 1"),
    ("llama-server --api-key=f-SECRET", "f-SECRET", "llama-server --api-key=***"),
    ("error at http://a:pw-SECRET@h/v1 and http://b@g/v1", "pw-SECRET", "error at http://***@h/v1 and http://***@g/v1"),
])
def test_redact_blanks_each_form(text, secret, shown):
    assert redact(text) == shown
    assert secret not in redact(text)


def test_redact_leaves_text_without_credentials_alone():
    for text in ("http://127.0.0.1:8000/v1", "http://h/v1?model=a&n=2", "mail user@example.com", "--api-key --port 1",
                 "the key=value pair", "--tokens 5"):
        assert redact(text) == text


def test_redact_blanks_the_api_key_variables_value_anywhere(env_key, monkeypatch):
    assert redact(f"server said: bad key {env_key}!") == f"server said: bad key {REDACTED}!"
    monkeypatch.setenv("OPENAI_API_KEY", "openai-SECRET-77")
    assert redact("k=openai-SECRET-77") == f"k={REDACTED}"
    monkeypatch.setenv("DRAFTSMITH_API_KEY", "EMPTY")  # too short to be told from a word: left alone
    assert redact("EMPTY list") == "EMPTY list"


def test_redact_walks_a_config_and_keeps_its_shape():
    cfg = {"endpoints": ("http://u:c-SECRET@h/v1#4",), "n": 3, "nested": [{"url": "http://h?token=t-SECRET"}, None],
           "http://k:key-SECRET@h": 1.5}
    out = redact(cfg)
    assert out == {"endpoints": ("http://***@h/v1#4",), "n": 3, "nested": [{"url": "http://h?token=***"}, None],
                   "http://***@h": 1.5}
    assert "SECRET" not in json.dumps(out)


# ---------------------------------------------------------------- the verbs against stub servers


def test_regenerate_writes_and_prints_no_endpoint_credential(stub, stub2, env_key, tmp_path, capsys):
    secrets = ["regen-query-SECRET-1", "regen-pass-SECRET-2", "regen-user-SECRET-3", env_key]
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    endpoints = ["--endpoint", stub.url(query=f"api_key={secrets[0]}"),
                 "--endpoint", stub2.url(userinfo=f"{secrets[2]}:{secrets[1]}") + "#2"]
    for out, json_flag in (("conv.jsonl", []), ("conv-json.jsonl", ["--json"])):
        code = main(["regenerate", "--prompts", str(prompts), "--out", str(tmp_path / out),
                     *endpoints, *json_flag])
        assert code == 0
    printed = capsys.readouterr()
    assert leaks(secrets, tmp_path, printed.out, printed.err) == []
    assert f"127.0.0.1:{stub2.port}" in printed.out and REDACTED in printed.out  # the endpoint is named, blanked
    records = [json.loads(line) for line in (tmp_path / "conv.jsonl").read_text().splitlines()]
    assert len(records) == 3
    # the requests kept their credentials: the key in the query, the URL's user:password, the variable's key
    assert any(f"api_key={secrets[0]}" in path and auth == f"Bearer {env_key}" for path, auth in stub.seen)
    assert stub2.basic(secrets[2], secrets[1]) in {auth for _, auth in stub2.seen}


def test_a_failing_endpoints_error_names_it_without_its_credential(env_key, tmp_path, capsys):
    secrets = ["down-pass-SECRET-4", "down-key-SECRET-5", env_key]
    url = f"http://down:{secrets[0]}@127.0.0.1:{free_port()}/v1?key={secrets[1]}"
    code = main(["regenerate", "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--out",
                 str(tmp_path / "c.jsonl"), "--endpoint", url])
    printed = capsys.readouterr()
    assert code == 2 and "no endpoint answers" in printed.err
    assert leaks(secrets, tmp_path, printed.out, printed.err) == []


def test_bench_writes_and_prints_no_endpoint_credential(stub, stub2, env_key, tmp_path, capsys, monkeypatch):
    from draftsmith.bench import benchmark

    monkeypatch.setattr(benchmark, "SWITCH_SETTLE_S", 0.0)
    monkeypatch.setattr(benchmark, "SETTLE_MAX_S", 0.0)
    secrets = ["bench-pass-SECRET-6", "base-pass-SECRET-7", env_key]
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    common = ["bench", "--endpoint", stub.url(userinfo=f"bench:{secrets[0]}"),
              "--baseline-endpoint", stub2.url(userinfo=f"base:{secrets[1]}"), "--prompts", str(prompts),
              "--num-prompts", "2", "--concurrency", "1", "--warmup", "1", "--rounds", "1", "--max-tokens", "4"]
    main([*common, "--out", str(tmp_path / "bench")])
    main([*common, "--json"])
    printed = capsys.readouterr()
    assert leaks(secrets, tmp_path, printed.out, printed.err) == []
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["endpoint"] == f"http://***@127.0.0.1:{stub.port}"
    assert report["baseline"]["source"] == f"http://***@127.0.0.1:{stub2.port}"
    assert report["levels"][0]["requests"] == 2 and report["levels"][0]["failed"] == 0  # served with credentials
    assert stub.basic("bench", secrets[0]) in {auth for _, auth in stub.seen}
    assert stub2.basic("base", secrets[1]) in {auth for _, auth in stub2.seen}


def test_bench_serves_a_key_in_the_query_and_writes_none(stub, tmp_path, capsys, monkeypatch):
    """The paths bench adds (/v1, /metrics) go before the query, so the key reaches every request."""
    from draftsmith.bench import benchmark

    monkeypatch.setattr(benchmark, "SWITCH_SETTLE_S", 0.0)
    monkeypatch.setattr(benchmark, "SETTLE_MAX_S", 0.0)
    secret = "bench-query-SECRET-11"
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    main(["bench", "--endpoint", stub.url(path="", query=f"api_key={secret}"), "--prompts", str(prompts),
          "--num-prompts", "2", "--concurrency", "1", "--warmup", "1", "--rounds", "1", "--max-tokens", "4",
          "--out", str(tmp_path / "bench")])
    printed = capsys.readouterr()
    assert leaks([secret], tmp_path, printed.out, printed.err) == []
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["levels"][0]["requests"] == 2 and report["levels"][0]["failed"] == 0, printed.err[-2000:]
    paths = {path for path, _ in stub.seen}
    assert any(p.startswith("/v1/") and f"api_key={secret}" in p for p in paths), sorted(paths)
    assert any(p.startswith("/metrics") and f"api_key={secret}" in p for p in paths), sorted(paths)


def run_config(folder: Path, target: Path, endpoints: list[str], secrets: dict[str, str]) -> Path:
    """The user's config, in `folder` (apart from tmp_path, where everything draftsmith writes is searched)."""
    cfg = {"target": str(target), "engine_python": "/nonexistent/python",
           "skip": ["capture", "train", "export", "eval", "check", "launch", "bench"],
           "regenerate": {"prompts": str(write_prompts(folder / "prompts.jsonl")), "endpoints": endpoints},
           "capture": {"engine": "vllm", "endpoint": f"http://127.0.0.1:1?api_key={secrets['capture']}"},
           "bench": {"baseline_endpoint": f"http://base:{secrets['baseline']}@127.0.0.1:1", "llamacpp_k": []}}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_run_writes_and_prints_no_credential_of_its_config(stub, env_key, tiny_target, tmp_path, tmp_path_factory,
                                                           capsys):
    secrets = {"regenerate": "run-regen-SECRET-8", "capture": "run-capture-SECRET-9",
               "baseline": "run-base-SECRET-10"}
    cfg = run_config(tmp_path_factory.mktemp("input"), tiny_target, [stub.url(userinfo=f"u:{secrets['regenerate']}")], secrets)
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out)]) == 0
    assert main(["report", str(out), "--json"]) == 0
    printed = capsys.readouterr()
    planted = [*secrets.values(), env_key]
    assert leaks(planted, tmp_path, printed.out, printed.err) == []
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["regenerate"]["endpoints"] == [f"http://***@127.0.0.1:{stub.port}/v1"]
    assert saved["bench"]["baseline_endpoint"] == "http://***@127.0.0.1:1"
    assert saved["capture"]["endpoint"] == "http://127.0.0.1:1?api_key=***"
    assert yaml.safe_load((out / "run_config.yaml").read_text()) == saved
    assert json.loads((out / "report.json").read_text())["config"] == saved
    assert stub.basic("u", secrets["regenerate"]) in {auth for _, auth in stub.seen}


def test_a_failed_runs_summary_and_report_keep_no_credential(env_key, tiny_target, tmp_path, tmp_path_factory,
                                                             capsys):
    secrets = {"regenerate": "run-down-SECRET-11", "capture": "run-capture-SECRET-12",
               "baseline": "run-base-SECRET-13"}
    down = f"http://u:{secrets['regenerate']}@127.0.0.1:{free_port()}/v1"
    out = tmp_path / "run"
    cfg = run_config(tmp_path_factory.mktemp("input"), tiny_target, [down], secrets)
    assert main(["run", str(cfg), "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert leaks([*secrets.values(), env_key], tmp_path, printed.out, printed.err) == []
    failed = json.loads((out / "summary.json").read_text())["failed"]
    assert failed["stage"] == "regenerate" and f"http://***@127.0.0.1:" in failed["error"]


def test_launch_prints_the_engine_command_without_its_key(env_key, tmp_path, capsys):
    secret = "launch-key-SECRET-14"
    engine = [sys.executable, "-c", "import sys; print('engine starting'); sys.exit(3)", "--api-key", secret]
    code = main(["launch", "--log", str(tmp_path / "engine.log"), "--timeout", "30", "--", *engine])
    printed = capsys.readouterr()
    assert code == 3
    assert "--api-key ***" in printed.err  # the command line is shown, its key blanked
    assert leaks([secret, env_key], tmp_path, printed.out, printed.err) == []


def test_an_engine_command_that_cannot_start_is_refused_without_its_key(tmp_path):
    secret = "launch-spawn-SECRET-15"
    r = subprocess.run([sys.executable, "-m", "draftsmith.cli", "launch", "--log", str(tmp_path / "e.log"), "--",
                        str(tmp_path / "no-such-engine"), "serve", f"--api-key={secret}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "could not start the engine command" in r.stderr
    assert leaks([secret], tmp_path, r.stdout, r.stderr) == []
