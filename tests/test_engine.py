"""`draftsmith.engines.process`: readiness means /health and /v1/models, and a served process tree is gone afterwards.

Fake servers only (a stdlib HTTP server in a thread or in a child process): unit tier, seconds.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from draftsmith.engines.process import alive, descendants, free_port, probe_ready, release, serve_process, spawn, stop_tree
from draftsmith.errors import DraftsmithError


class _Routes(http.server.BaseHTTPRequestHandler):
    models_up = False

    def do_GET(self):  # noqa: N802 (http.server's name)
        ok = self.path == "/health" or (self.path == "/v1/models" and type(self).models_up)
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_only_server():
    handler = type("Routes", (_Routes,), {"models_up": False})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_health_alone_is_not_ready(health_only_server):
    base, routes = health_only_server
    assert not probe_ready(base)  # /health answers 200, /v1/models 503: the OpenAI routes are not up
    routes.models_up = True
    assert probe_ready(base)


def test_nothing_listening_is_not_ready():
    assert not probe_ready(f"http://127.0.0.1:{free_port()}")


SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    # a worker in its own session, as engines start them: only the PID walk of stop_tree reaches it
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_serve_process_yields_when_ready_and_stops_every_descendant(tmp_path):
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    before = set(descendants(os.getpid()))
    with serve_process([sys.executable, str(script), str(port)], port, tmp_path / "server.log", 60) as base:
        assert probe_ready(base)
        started = set(descendants(os.getpid())) - before
        assert len(started) >= 2, f"server and its worker expected below this process, got {started}"
    left = [pid for pid in started if alive(pid)]
    assert not left, f"processes {left} survived serve_process"


def test_a_server_that_dies_fails_fast_with_its_log(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; print('boom: no such model'); sys.exit(3)"]
    with pytest.raises(DraftsmithError, match="exited during start-up") as err:
        with serve_process(cmd, port, tmp_path / "dead.log", 60):
            pass
    assert "exit code 3" in err.value.got and "boom: no such model" in err.value.fix


# A parent that starts the fake server through engine.spawn, prints its PID once the server answers,
# then sleeps until the test SIGKILLs it: no `finally` of ours runs.
PARENT = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from draftsmith.engines.process import free_port, probe_ready, spawn
    port = free_port()
    procs = []
    # from a worker thread that then ends: the server must outlive the thread (PR_SET_PDEATHSIG would not)
    t = threading.Thread(target=lambda: procs.append(spawn([sys.executable, sys.argv[1], str(port)], Path(sys.argv[2]))))
    t.start(); t.join()
    while not probe_ready(f"http://127.0.0.1:{port}"):
        time.sleep(0.1)
    time.sleep(1.0)  # the thread that spawned it is long gone
    print(procs[0].pid, port, flush=True)
    time.sleep(600)
""")


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_kill_9_of_the_parent_stops_the_server_it_spawned(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "server.py"), str(tmp_path / "s.log")],
                              stdout=subprocess.PIPE, text=True, env=env)
    tree: list[int] = []
    try:
        server_pid, port = map(int, parent.stdout.readline().split())
        tree = [server_pid, *descendants(server_pid)]
        assert len(tree) >= 2 and probe_ready(f"http://127.0.0.1:{port}"), \
            "the server (and its own-session worker) should be up and outlive the thread that spawned it"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        left = _wait_gone(tree, within_s=10)
        assert not left, f"processes {left} outlived their SIGKILLed parent (log: {(tmp_path / 's.log').read_text()})"
        assert "parent" in (tmp_path / "s.log").read_text() and "is gone" in (tmp_path / "s.log").read_text()
    finally:  # a failing run must not leave its orphans behind
        parent.kill()
        for pid in [*tree, *descendants(os.getpid())]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_tree_also_ends_the_guard_and_release_lets_a_server_outlive_us(tmp_path):
    before = set(descendants(os.getpid()))
    proc = spawn([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "a.log")
    ours = set(descendants(os.getpid())) - before
    stop_tree(proc)
    assert len(ours) == 2, f"the server and its guard expected, got {ours}"
    assert not _wait_gone(sorted(ours), within_s=0), "stop_tree left the server or its guard running"
    proc = spawn([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "b.log")
    release(proc)
    try:
        assert alive(proc.pid) and set(descendants(os.getpid())) - before == {proc.pid}, \
            "release should stop only the guard"
    finally:
        stop_tree(proc)
