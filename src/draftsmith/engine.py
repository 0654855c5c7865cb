"""Serving engines as external processes: where their interpreters live and how to start them.

vLLM and SGLang pin their own torch, so draftsmith never imports them: each lives in its own
virtualenv (by default `<cache>/venvs/<engine>`, made by `make engine-venv`), and draftsmith runs its
Python as a subprocess and talks to it over HTTP on 127.0.0.1.

`serve(...)` is a context manager that starts `vllm`'s OpenAI server, waits for `/health`, yields the
base URL and stops the whole process group on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.target import cache_dir

ENGINE_ENV_VARS = {"vllm": "DRAFTSMITH_VLLM_PYTHON", "sglang": "DRAFTSMITH_SGLANG_PYTHON"}
# vLLM's CPU backend takes most of the machine's memory for KV cache unless told
# (reference/cpu-engines.md, known fix 3).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def engine_python(engine: str) -> Path:
    """The Python interpreter of an engine's virtualenv: $DRAFTSMITH_<ENGINE>_PYTHON or the cache venv."""
    override = os.environ.get(ENGINE_ENV_VARS.get(engine, ""))
    path = Path(override) if override else cache_dir() / "venvs" / engine / "bin" / "python"
    if not path.is_file():
        raise DraftsmithError(
            f"no {engine} interpreter found",
            got=str(path),
            expected=f"a virtualenv with {engine} installed",
            fix=f"run `make engine-venv` (installs vllm-cpu into {cache_dir() / 'venvs' / engine}) "
            f"or set {ENGINE_ENV_VARS.get(engine)} to its python",
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class VllmServe:
    """Everything that defines one `vllm serve` start."""

    target: Path
    drafter: Path | None = None
    num_speculative_tokens: int = 3
    port: int = 0
    dtype: str = "float32"
    max_model_len: int = 2048
    extra_args: tuple[str, ...] = ()

    def speculative_config(self) -> dict | None:
        if self.drafter is None:
            return None
        return {"method": "eagle3", "model": str(self.drafter), "num_speculative_tokens": self.num_speculative_tokens}

    def command(self, python: Path) -> list[str]:
        """The argument list; `vllm-cpu` has no `vllm` console script, so run the API server module."""
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.target),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--served-model-name", "target"]
        spec = self.speculative_config()
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + list(self.extra_args)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Poll `/health` until it answers 200; fail fast when the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise DraftsmithError("engine exited during start-up", got=f"exit code {proc.returncode}",
                                  expected="a server answering /health", fix=f"read {log}; `draftsmith diagnose {log}`"
                                  + ("\n" + tail if tail else ""))
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise DraftsmithError("engine did not become ready in time", got=f"no /health after {timeout_s:.0f} s",
                          expected="a ready server", fix=f"read {log}")


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after `grace_s`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def serve(spec: VllmServe, log: Path, timeout_s: float = 300.0, python: Path | None = None) -> Iterator[str]:
    """Start vLLM's OpenAI server for `spec`, yield its base URL once healthy, stop it on exit."""
    python = python or engine_python("vllm")
    if spec.port == 0:
        spec = VllmServe(**{**spec.__dict__, "port": free_port()})
    with serve_process(spec.command(python), spec.port, log, timeout_s, {**os.environ, **VLLM_CPU_ENV}) as base:
        yield base


@contextlib.contextmanager
def serve_process(cmd: list[str], port: int, log: Path, timeout_s: float, env: dict | None = None) -> Iterator[str]:
    """Run a server command in its own process group (output to `log`), yield its base URL once `/health`
    answers, stop the group on exit. Shared by vLLM (`serve`) and llama.cpp (`llamacpp.serve`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s, log)
        yield base
    finally:
        stop_group(proc)
