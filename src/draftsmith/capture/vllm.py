"""`draftsmith capture --engine vllm`: capture hidden states through a vLLM server, into the same store.

The target runs in vLLM (tensor parallel as the server is) with the `extract_hidden_states`
speculative method: the server prefills each request and draftsmith's KV connector
(`draftsmith/capture/connector.py`, loaded by path into the server) writes the states of the requested layers
to a folder of bounded size. This module is the client:

1. tokenize every conversation exactly as the in-process capture does (`capture.tokenized_conversations`);
2. start `vllm serve` with the capture flags (`server_args`), or use `--endpoint` for a server the user
   started with the flags `--print-server-args` prints;
3. send each conversation as token ids (`/v1/completions`, `max_tokens` 1, temperature 0), check that
   the server's `prompt_token_ids` are ours (the first differing token is shown when not);
4. read the connector's file, apply the final norm to the last layer's state (vLLM's id N is the
   state *before* the norm, docs/engines.md §9), check it (`draftsmith.capture.sanity`), append the
   sample to the feature store and delete the file.

The connector folder (`--hs-dir`) may be shared (`/dev/shm`): draftsmith deletes only the files of the
requests this run sent. Each request carries an id with this run's random token (`X-Request-Id`); vLLM
names the request after it and the connector names its files after the request
(`<hs-dir>/cmpl-<id>-0.safetensors`, `.lock`, `.tmp`, `.error`). Each file goes once it is read, and
whatever this run's requests left (a failure mid-way) goes when the capture ends; nothing else is touched.

vLLM ids: the aux ids are boundary indices and vLLM reads explicit ids as boundary indices
(`conventions.aux_ids_for_format(..., "vllm")`); the last id, N, gives the state the final norm turns
into the store's `last`. Resume is the store's: a rerun skips the samples in complete shards.

    draftsmith capture --engine vllm --conversations conv.jsonl --out store
    draftsmith capture --engine vllm --endpoint http://10.0.0.5:8000 --hs-dir /dev/shm/hs ...
    draftsmith capture --print-server-args --target ./Kimi-K2.5 --hs-dir /dev/shm/hs --tp 8
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import shutil
import time
import uuid
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.capture.local import (DEFAULT_MAX_BYTES, CaptureSettings, CaptureSummary, capture_identity, finish_store, head_tensors, require_conversations,
                               supervised_counts, tokenized_conversations)
from draftsmith.regenerate.chat import TokenizedSample
from draftsmith.conventions import aux_ids_for_format
from draftsmith.errors import DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.capture.sanity import check_greedy, check_states
from draftsmith.capture.store import Sample, StoreWriter, bytes_per_token
from draftsmith.target import cache_dir, describe_target, read_config, resolve_target, target_argmax, target_aux_ids

CONNECTOR_MODULE = "draftsmith_hs_connector"
CONNECTOR_CLASS = "DraftsmithHiddenStatesConnector"
ERROR_SUFFIX = ".error"  # connector.ERROR_SUFFIX: the connector cannot import draftsmith
CONNECTOR_SUFFIXES = (".safetensors", ".lock", ".tmp", ERROR_SUFFIX)  # a request's files (connector._save, stock lock)
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class EngineSettings:
    """How the server captures: where the connector writes, how much it may hold, tensor parallelism."""

    hs_dir: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    tensor_parallel: int = 1
    space_wait_s: float = 600.0
    concurrency: int = 4
    python: Path | None = None
    """The vLLM interpreter that starts the server (None: engine.engine_python)."""


def engine_layer_ids(aux_ids: tuple[int, ...], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: the aux ids as vLLM reads them, then N (the last layer, before the norm)."""
    return aux_ids_for_format(aux_ids, "vllm") + [num_layers]


def check_tensor_parallel(spec, tp: int) -> None:
    """vLLM splits attention heads across TP ranks: refuse, before a server start, a size that cannot."""
    if tp < 1 or spec.num_heads % tp:
        fits = [n for n in range(1, spec.num_heads + 1) if spec.num_heads % n == 0 and n <= 16]
        raise DraftsmithError("tensor-parallel size does not divide the target's attention heads",
                              got=f"--tp {tp} for {spec.num_heads} heads",
                              expected=f"a divisor of {spec.num_heads}: {', '.join(map(str, fits))}",
                              fix="pick one of those (vLLM refuses the start otherwise: 'Total number of attention "
                              "heads ... must be divisible by tensor parallel size')")


def install_connector(folder: Path) -> Path:
    """Copy the connector module into `folder` (the server's PYTHONPATH entry); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("connector.py"), folder / f"{CONNECTOR_MODULE}.py")
    return folder


def server_args(layer_ids: list[int], s: EngineSettings) -> list[str]:
    """The `vllm serve` flags that turn a server into a capture server (prefix caching off: a prefix hit
    truncates the capture)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(s.hs_dir), "draftsmith_max_bytes": s.max_bytes,
                                        "draftsmith_space_wait_s": s.space_wait_s}}
    return ["--no-enable-prefix-caching", "--tensor-parallel-size", str(s.tensor_parallel),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


# ---------------------------------------------------------------- one request

@dataclass(frozen=True)
class RequestIds:
    """The request ids one capture sends: `draftsmith-<token>-<n>`, the token random per run. vLLM takes a
    request's id from its `X-Request-Id` header (`_base_request_id`) and the connector names the request's
    files after it, so a file in the connector folder is this run's exactly when its name holds the token."""

    token: str = field(default_factory=lambda: f"draftsmith-{uuid.uuid4().hex[:16]}")
    counter: itertools.count = field(default_factory=itertools.count, compare=False)

    def next(self) -> str:
        return f"{self.token}-{next(self.counter)}"  # next() on a count is atomic: threads may share it

    def owns(self, path: Path) -> bool:
        return self.token in Path(path).name and Path(path).name.endswith(CONNECTOR_SUFFIXES)


def run_files(folder: Path, ids: RequestIds) -> list[Path]:
    """The connector's files in `folder` that belong to this run's requests, sorted."""
    if not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and ids.owns(p))


def discard_run_files(folder: Path, ids: RequestIds) -> list[Path]:
    """Delete what this run's requests left in the connector folder (nothing else); returns what went."""
    gone = run_files(folder, ids)
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


@dataclass(frozen=True)
class EngineReply:
    """What the server answered for one prompt: its token ids, the greedy next token, the states' file."""

    prompt_token_ids: list[int]
    next_token: int
    states_path: Path


def post_json(url: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S, request_id: str | None = None) -> dict:
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise DraftsmithError("the capture server refused a request", got=f"HTTP {exc.code}: "
                              f"{exc.read().decode(errors='replace')[:500]}", expected="a completion",
                              fix="check the server log; prompts longer than --max-model-len are refused") from exc
    except OSError as exc:
        raise DraftsmithError("the capture server did not answer", got=f"{type(exc).__name__}: {exc}",
                              expected=f"a reply from {url}", fix="check that the server is up; rerun the same "
                              "command to resume after the last complete shard") from exc


def request_states(base_url: str, ids: list[int], request_ids: RequestIds | None = None) -> EngineReply:
    """Prefill `ids` once (one greedy token) and return where the connector writes their states.

    Raises:
        DraftsmithError: a server without the capture flags, or a states file not named for this request
            (draftsmith would not know it may delete it).
    """
    request_ids = request_ids or RequestIds()
    body = {"model": "target", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
    request_id = request_ids.next()
    reply = post_json(base_url + "/v1/completions", body, request_id=request_id)
    params = reply.get("kv_transfer_params") or {}
    if "hidden_states_path" not in params:
        raise DraftsmithError(
            "the server does not capture hidden states",
            got=f"no kv_transfer_params.hidden_states_path in its reply (keys: {sorted(reply)})",
            expected="a vLLM server started with --speculative-config '{\"method\": \"extract_hidden_states\", ...}' "
            "and --kv-transfer-config naming a hidden-states connector",
            fix="restart it with the flags `draftsmith capture --print-server-args` prints, or drop --endpoint")
    path = Path(params["hidden_states_path"])
    if request_id not in path.name:
        raise DraftsmithError("the server's hidden-states file is not named for draftsmith's request",
                              got=f"{path} for request {request_id}",
                              expected=f"a file named after the X-Request-Id header, e.g. cmpl-{request_id}-0.safetensors",
                              fix="serve with the flags `draftsmith capture --print-server-args` prints (draftsmith's "
                                  "connector, no custom hidden_states_path); draftsmith deletes only its own files")
    choice = reply["choices"][0]
    return EngineReply(list(choice.get("prompt_token_ids") or []), int((choice.get("token_ids") or [-1])[0]), path)


def check_prompt_ids(ours: list[int], theirs: list[int], tokenizer) -> None:
    """Fail with the first differing token when the server tokenized differently from draftsmith."""
    if ours == theirs:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def show(ids: list[int]) -> str:
        return f"{ids[i]} {tokenizer.decode([ids[i]])!r}" if i < len(ids) else "(end)"

    raise DraftsmithError(
        f"the server's prompt tokens differ from draftsmith's at position {i}",
        got=f"server {show(theirs)} ({len(theirs)} tokens)", expected=f"draftsmith {show(ours)} ({len(ours)} tokens)",
        fix="serve the same target directory (tokenizer and chat template) that capture reads with --target")


def check_server_tokenizer(base_url: str, sample: TokenizedSample, tokenizer) -> None:
    """The server's tokenizer must encode the first conversation's text as draftsmith's does (token ids are
    sent as ids, so only this shows a server serving another tokenizer or vocabulary)."""
    text = tokenizer.decode(sample.input_ids)
    ours = tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = post_json(base_url + "/tokenize", {"model": "target", "prompt": text, "add_special_tokens": False})
    check_prompt_ids(ours, list(reply.get("tokens") or []), tokenizer)


def read_states(path: Path, timeout_s: float = REQUEST_TIMEOUT_S) -> torch.Tensor:
    """The connector's states for one request, (T, n_ids, H), once its writer released the lock."""
    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout_s
    while not lock.exists() and not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the connector is done with this request
    error = Path(str(path) + ERROR_SUFFIX)
    if error.exists():
        reason = json.loads(error.read_text()).get("error", "")
        raise DraftsmithError("the connector could not write a request's hidden states", got=reason,
                              expected=f"{path.name} in {path.parent}",
                              fix="free space there or raise --hs-max-bytes; consumed files are deleted as they "
                              "are stored, so lower --concurrency if the budget is below a few requests")
    if not path.exists():
        raise DraftsmithError("hidden states file missing", got=f"no {path}", expected="the connector's file",
                              fix="the capture server must run on this machine and write to --hs-dir")
    return load_file(str(path))["hidden_states"]


def discard(path: Path) -> None:
    for p in (path, Path(str(path) + ".lock"), Path(str(path) + ERROR_SUFFIX)):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------- states -> sample

@dataclass(frozen=True)
class TargetHead:
    """The frozen target tensors the client needs: final norm weight and eps, embeddings, lm_head."""

    norm: torch.Tensor
    eps: float
    embed: torch.Tensor
    head: torch.Tensor


def load_target_head(model_dir: Path) -> TargetHead:
    """Read only the final norm, the embeddings and the head from the target's safetensors."""
    found: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                for name in ("model.norm.weight", "embed_tokens.weight", "lm_head.weight"):
                    if key.endswith(name) and name not in found:
                        found[name] = st.get_tensor(key)
    if "model.norm.weight" not in found or "embed_tokens.weight" not in found:
        raise DraftsmithError("target weights lack the final norm or the embeddings", got=str(sorted(found)),
                              expected="*.safetensors with model.norm.weight and model.embed_tokens.weight",
                              fix="point --target at the Hugging Face directory the server serves")
    eps = describe_target(read_config(model_dir)).rms_norm_eps
    embed = found["embed_tokens.weight"]
    return TargetHead(found["model.norm.weight"], eps, embed, found.get("lm_head.weight", embed))


def final_norm(x: torch.Tensor, head: TargetHead) -> torch.Tensor:
    """RMSNorm as the Llama family applies it (in fp32, then the weight). x (T, H)"""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + head.eps)
    return head.norm.float() * x32


def to_sample(states: torch.Tensor, sample: TokenizedSample, head: TargetHead) -> Sample:
    """A store sample from the connector's (T, 4, H) states: aux (T, 3H), last = norm(state N) (T, H)."""
    T, n, H = states.shape
    aux = states[:, :n - 1].reshape(T, (n - 1) * H)  # (T, 3H), in the order the ids were asked
    last = final_norm(states[:, n - 1], head)  # (T, H)
    argmax = target_argmax(last, head.head.float())
    return Sample(torch.tensor(sample.input_ids), torch.tensor(sample.loss_mask), aux.to(torch.bfloat16),
                  last.to(torch.bfloat16), argmax)


# ---------------------------------------------------------------- the capture

def in_order(pool: ThreadPoolExecutor, fn, items: list, window: int) -> Iterator:
    """fn over items with at most `window` calls submitted ahead of the consumer, results in order (unlike
    `pool.map`, which submits every item at once: the server would write every file before one is stored)."""
    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def capture_from_engine(base_url: str, todo: list[TokenizedSample], writer: StoreWriter, head: TargetHead,
                        tokenizer, concurrency: int, request_ids: RequestIds | None = None) -> int:
    """Send `todo` with `concurrency` requests in flight, store the samples in order; returns tokens stored."""
    tokens = 0
    request_ids = request_ids or RequestIds()
    if todo:
        check_server_tokenizer(base_url, todo[0], tokenizer)
    with ThreadPoolExecutor(concurrency) as pool, progress_bar("capture", total=len(todo), unit="samples") as bar:
        for sample, reply in zip(todo, in_order(pool, lambda s: request_states(base_url, s.input_ids, request_ids),
                                                 todo, concurrency)):
            try:
                check_prompt_ids(sample.input_ids, reply.prompt_token_ids, tokenizer)
                stored = to_sample(read_states(reply.states_path), sample, head)
                check_states(stored, writer.samples_done + len(writer.pending))
                check_greedy(stored.last[-1:].float(), head.head.float(), reply.next_token)
                writer.add(stored)
            finally:
                discard(reply.states_path)
            tokens += len(sample.input_ids)
            bar.advance(1, tokens=tokens)
    return tokens


@contextlib.contextmanager
def capture_server(model_dir: Path, layer_ids: list[int], s: EngineSettings, log: Path, max_model_len: int,
                   dtype: str) -> Iterator[str]:
    """Start `vllm serve` with the capture flags and the connector on its path; yield its URL; stop it."""
    import os

    from draftsmith.engines.process import VLLM_CPU_ENV, VllmServe, engine_python, free_port, serve_process

    module_dir = install_connector(log.parent / "connector")
    spec = VllmServe(target=model_dir, port=free_port(), dtype=dtype, max_model_len=max_model_len,
                     extra_args=tuple(server_args(layer_ids, s)))
    path = os.pathsep.join([str(module_dir)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, **VLLM_CPU_ENV, "PYTHONPATH": path}
    with serve_process(spec.command(s.python or engine_python("vllm")), spec.port, log, 900.0, env) as base:
        yield base


def engine_capture(conversations: Path, out: Path, settings: EngineSettings, target: str = "smollm2",
                   aux_ids: tuple[int, ...] | None = None, max_length: int = 2048, shard_tokens: int = 1 << 16,
                   endpoint: str | None = None, dtype: str = "float32", max_store_bytes: int | None = None,
                   store_wait_timeout_s: float = 3600.0) -> CaptureSummary:
    """Capture a feature store through vLLM (resumes an interrupted capture, like the in-process one).

    The engine is found (a server to start needs vLLM's interpreter) before anything is read or written; in
    `settings.hs_dir` only this run's requests' files are deleted."""
    from transformers import AutoTokenizer

    from draftsmith.engines.process import engine_python

    if endpoint is None:
        settings = dataclasses.replace(settings, python=settings.python or engine_python("vllm"))
    require_conversations(conversations)
    model_dir = resolve_target(target)
    spec = describe_target(read_config(model_dir))
    aux_ids = target_aux_ids(target, spec, aux_ids)
    check_tensor_parallel(spec, settings.tensor_parallel)
    writer = StoreWriter(out, capture_identity(model_dir, target, aux_ids, spec, max_length, Path(conversations)),
                         shard_tokens, max_store_bytes, store_wait_timeout_s)
    if writer.manifest.get("complete"):
        m = writer.manifest
        return CaptureSummary(0, m["num_samples"], 0, 0.0, bytes_per_token(spec.hidden_size))  # a finished store
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = [s for _, s in tokenized_conversations(Path(conversations), tokenizer, max_length)]
    skip = writer.samples_done
    todo = samples[skip:]
    head = load_target_head(model_dir)
    counts = supervised_counts(samples, spec.vocab_size)
    writer.publish(counts, head_tensors(head.embed, head.head))  # a follower can start now (train --follow)
    start = time.perf_counter()
    layer_ids = engine_layer_ids(aux_ids, spec.num_layers)
    request_ids = RequestIds()
    try:
        with (contextlib.nullcontext(endpoint.rstrip("/")) if endpoint else
              capture_server(model_dir, layer_ids, settings, Path(out) / "engine" / "vllm.log",
                             max(len(s.input_ids) for s in samples) + 8, dtype)) as base:
            tokens = capture_from_engine(base, todo, writer, head, tokenizer, settings.concurrency, request_ids)
    finally:  # a failure mid-way leaves the files of requests in flight; the server has stopped (or answered them)
        discard_run_files(settings.hs_dir, request_ids)
    finish_store(writer, counts, head.embed, head.head, spec.hidden_size)
    return CaptureSummary(len(todo), skip, tokens, time.perf_counter() - start, bytes_per_token(spec.hidden_size))


def print_server_args(target: str, aux_ids: tuple[int, ...] | None, settings: EngineSettings) -> str:
    """The `vllm serve` command line for `--endpoint` capture (the connector installed under the cache)."""
    import shlex

    model_dir = resolve_target(target)
    spec = describe_target(read_config(model_dir))
    aux_ids = target_aux_ids(target, spec, aux_ids)
    check_tensor_parallel(spec, settings.tensor_parallel)
    module_dir = install_connector(cache_dir() / "vllm-connector")
    args = server_args(engine_layer_ids(aux_ids, spec.num_layers), settings)
    return (f"env PYTHONPATH={shlex.quote(str(module_dir))} vllm serve {shlex.quote(str(model_dir))} "
            "--served-model-name target " + shlex.join(args))


def engine_settings(s: CaptureSettings, store: Path | None, python: Path | None = None) -> EngineSettings:
    """The server side of `capture`'s settings; the connector folder defaults to STORE/engine/hs."""
    hs_dir = Path(s.hs_dir) if s.hs_dir else (Path(store) / "engine" / "hs" if store else Path("/dev/shm/draftsmith-hs"))
    return EngineSettings(hs_dir.resolve(), s.hs_max_bytes, s.tensor_parallel, concurrency=s.concurrency, python=python)


def run_engine_capture(s: CaptureSettings, args) -> int:
    """The `--engine vllm` branch of `draftsmith capture`."""
    from draftsmith.capture.local import parse_ids, print_summary

    settings = engine_settings(s, args.out)
    if args.print_server_args:
        print(print_server_args(args.target, parse_ids(args.aux_ids), settings))
        return 0
    summary = engine_capture(args.conversations, args.out, settings, args.target, parse_ids(args.aux_ids),
                             s.max_length, args.shard_tokens, s.endpoint, s.dtype, s.max_store_bytes,
                             s.store_wait_timeout_s)
    print_summary(summary, args.out)
    return 0
