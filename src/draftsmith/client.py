"""OpenAI-compatible servers (vLLM, SGLang, llama-server, any OpenAI API): how draftsmith reaches them.

One home for what every caller of such a server needs:

- base URLs: `parse_endpoint` reads an `--endpoint URL[#N]` spec, `normalize_base` gives the server root
  (no trailing `/v1`);
- the API key: `api_key_from_env` reads $DRAFTSMITH_API_KEY or $OPENAI_API_KEY, never a flag, never printed;
- secrets: `redact` blanks every credential (URL user:password, key query parameters, `Authorization`
  values, `--api-key` flags, the API key's value) in a string, a URL or a whole config, for whatever
  draftsmith writes or prints; the requests themselves keep their credentials;
- the client: `open_client` builds an `openai.AsyncOpenAI` with that key (and a URL's query as default query
  parameters) and no retries of its own;
- retries: `classify` turns a failed request into a `Failure` (retry or not, connection lost or not,
  `Retry-After`), `backoff_delay` spaces retries, `with_retries` runs one request under that policy;
- the served model: `served_model` asks `GET /models` which model a server serves.

Callers: regenerate/endpoints.py (chat and raw-prefix completions), bench (the load generator).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

try:
    import openai
except ImportError:  # the local backends work without the client; open_client says how to install it
    openai = None

from draftsmith.errors import DraftsmithError

API_KEY_ENV_VARS = ("DRAFTSMITH_API_KEY", "OPENAI_API_KEY")
# vLLM and SGLang accept any key when started without --api-key; the openai client insists on one.
NO_API_KEY = "EMPTY"
# Statuses worth retrying: timeouts, conflicts, rate limits and server-side failures (RFC 9110 §15.6).
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})

REDACTED = "***"
# Query parameters that carry a credential: OpenAI-compatible gateways (`api_key`, `api-key`), Google (`key`),
# OAuth (`access_token`), signed URLs (`sig`, `signature`).
SECRET_QUERY_PARAMS = ("api_key", "api-key", "apikey", "key", "token", "access_token", "auth", "password", "secret",
                       "sig", "signature")
# Command-line flags whose value is a credential: vLLM, SGLang and llama-server `--api-key`, hub tokens.
SECRET_FLAGS = ("--api-key", "--api-key-file", "--hf-token", "--token")
# An API-key variable shorter than this is blanked only where a key is expected (flags, headers, queries), not
# in free text: a value like `EMPTY` or `x` would blank ordinary words.
MIN_LITERAL_SECRET_CHARS = 6

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------
# Base URLs and the key


def parse_endpoint(spec: str, default_concurrency: int) -> tuple[str, int]:
    """`http://host:8000` or `http://host:8000/v1#32` -> (base URL ending in /v1 unless a path is given, concurrency)."""
    url, _, conc = spec.partition("#")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DraftsmithError("bad --endpoint", got=repr(spec), expected="http[s]://HOST:PORT[/PATH][#CONCURRENCY]",
                              fix="e.g. --endpoint http://127.0.0.1:8000/v1#16")
    if conc and not (conc.isdigit() and int(conc) > 0):
        raise DraftsmithError("bad concurrency in --endpoint", got=repr(spec), expected="URL#N with N >= 1",
                              fix="e.g. --endpoint http://127.0.0.1:8000/v1#16")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, "")), int(conc) if conc else default_concurrency


def normalize_base(url: str) -> str:
    """`http://host:port` (and any path before `/v1`) from a URL that may end in `/` or `/v1`; a query (a key in
    `?api_key=...`) is kept, so `with_path` can put a path in front of it."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DraftsmithError("endpoint is not an http(s) URL", got=repr(redact(url)),
                              expected="for example http://127.0.0.1:8000", fix="pass the server's base URL")
    path = parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path.removesuffix("/v1"), fragment=""))


def with_path(url: str, path: str) -> str:
    """`url` with `path` added to its path and its query kept after it: (`http://h/?k=1`, `/v1`) -> `http://h/v1?k=1`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


def api_key_from_env() -> str:
    """The API key from the environment (never a flag); servers without auth accept any value."""
    return next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), NO_API_KEY)


# ---------------------------------------------------------------------------------------------------
# Secrets

_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s'\"<>@]*(?:@[^/?#\s'\"<>@]*)*@")
_QUERY = re.compile(r"(?P<name>[?&;](?:%s)=)[^&#\s'\"<>]*" % "|".join(map(re.escape, SECRET_QUERY_PARAMS)),
                    re.IGNORECASE)
_FLAG = re.compile(r"(?P<name>(?:%s)(?:=|\s+))(?!-)[^\s'\"]+" % "|".join(map(re.escape, SECRET_FLAGS)))
_HEADER = re.compile(r"(?P<name>\b(?:authorization|x-api-key|api-key)[\"']?\s*[:=]\s*[\"']?"
                     r"(?:(?:bearer|basic|token)\s+)?)[^\s\"',}]+", re.IGNORECASE)
_BEARER = re.compile(r"(?P<name>\bbearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


def redact(value: T) -> T:
    """`value` with every credential in it replaced by `***`, for anything draftsmith writes or prints.

    Blanks a URL's user:password (`http://***@host`), secret query parameters (`?api_key=***`, `&key=***`,
    SECRET_QUERY_PARAMS), `Authorization: Bearer ***` and `x-api-key` header values, secret flags'
    values (`--api-key ***`, SECRET_FLAGS), and the API key from $DRAFTSMITH_API_KEY / $OPENAI_API_KEY wherever
    it appears. A string, a URL, or a config: dicts, lists and tuples are redacted item by item (keys too);
    anything else is returned as is.
    """
    if isinstance(value, str):
        return _redact_text(value)
    if isinstance(value, dict):
        return {redact(k): redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def _redact_text(text: str) -> str:
    for var in API_KEY_ENV_VARS:
        secret = os.environ.get(var, "")
        if len(secret) >= MIN_LITERAL_SECRET_CHARS:
            text = text.replace(secret, REDACTED)
    text = _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)
    for pattern in (_QUERY, _FLAG, _HEADER, _BEARER):
        text = pattern.sub(rf"\g<name>{REDACTED}", text)
    return text


# ---------------------------------------------------------------------------------------------------
# The client


def require_openai() -> None:
    """Raise the install hint when the `openai` package is missing."""
    if openai is None:
        raise DraftsmithError("the endpoint backend needs the openai client", got="no Python package 'openai'",
                              expected="openai >= 1.40 (a draftsmith dependency)", fix="pip install 'openai>=1.40'")


def open_client(base_url: str, **options) -> openai.AsyncOpenAI:
    """An `AsyncOpenAI` for `base_url` (ending in /v1) with the key from the environment.

    It never retries by itself (`max_retries=0`): callers retry through `classify` and `backoff_delay`, which
    honour `Retry-After`, and regeneration moves a failed prompt to another endpoint. `options` go to the
    client as they are (`timeout`, `http_client`); one left out keeps the openai default.
    """
    require_openai()
    parts = urlsplit(base_url)  # a key in the query (`?api_key=...`) rides along on every request
    if parts.query:
        options = {"default_query": dict(parse_qsl(parts.query)), **options}
        base_url = urlunsplit(parts._replace(query=""))
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key_from_env(), max_retries=0, **options)


# ---------------------------------------------------------------------------------------------------
# Failures and retries


@dataclass(frozen=True)
class Failure:
    kind: str
    """Short, countable: refused, reset, timeout, http 503, bad reply."""
    reason: str
    retryable: bool
    connection: bool
    """The server could not be reached or dropped the connection (counts towards marking it down)."""
    retry_after_s: float | None = None


class BadReply(Exception):
    """A 200 response without a usable message."""


class RequestFailed(Exception):
    """A request that failed for good: not retryable, or still failing after the last retry."""

    def __init__(self, failure: Failure):
        super().__init__(failure.reason)
        self.failure = failure


def backoff_delay(retry: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before retry number `retry` (1-based): exponential, capped, with "equal jitter" so that
    clients failing together do not retry together (half fixed, half uniform random)."""
    ceiling = min(cap_s, base_s * 2 ** (retry - 1))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a `Retry-After` header: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return None


def classify(exc: Exception) -> Failure:
    """Turn an exception from one request into a retry decision; anything else (a bug) is raised again."""
    if isinstance(exc, openai.APITimeoutError):
        return Failure("timeout", "request timed out", True, True)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        text = f"{type(cause).__name__}: {cause}" if cause else str(exc)
        if "ConnectError" in text or "refused" in text.lower():
            return Failure("refused", f"cannot connect ({text[:200]})", True, True)
        return Failure("reset", f"connection lost mid-exchange ({text[:200]})", True, True)
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        detail = exc.message[:200] if exc.message else ""
        return Failure(f"http {status}", f"HTTP {status}: {detail}", status in RETRYABLE_STATUS, False,
                       parse_retry_after(exc.response.headers.get("retry-after")))
    if isinstance(exc, (BadReply, openai.APIResponseValidationError)):
        return Failure("bad reply", str(exc)[:200], True, False)
    raise exc


async def with_retries(request: Callable[[], Awaitable[T]], max_retries: int, rng: random.Random,
                       backoff_s: float = 0.5, backoff_max_s: float = 8.0) -> T:
    """`await request()`, retried up to `max_retries` times while its failure is retryable, each retry after
    the server's `Retry-After` or a jittered backoff.

    Raises:
        RequestFailed: the failure was not retryable, or the last retry failed too.
    """
    for attempt in range(max_retries + 1):
        try:
            return await request()
        except Exception as exc:  # classify raises again what is not a failed request
            failure = classify(exc)
            if not failure.retryable or attempt == max_retries:
                raise RequestFailed(failure) from exc
            await asyncio.sleep(failure.retry_after_s or backoff_delay(attempt + 1, backoff_s, backoff_max_s, rng))
    raise AssertionError("unreachable: the loop returns or raises")


# ---------------------------------------------------------------------------------------------------
# The served model


class NoServedModel(DraftsmithError):
    """`GET /models` failed, listed nothing, or did not list the model asked for; `got` says which."""


async def served_model(client: openai.AsyncOpenAI, wanted: str | None = None, timeout_s: float | None = None) -> str:
    """The model `client`'s server serves: `wanted` when the server lists it, else the first one it lists.

    Args:
        client: from `open_client`.
        wanted: the model name asked for (`--model`); None takes the server's first.
        timeout_s: wall time for the listing; None keeps the client's.

    Raises:
        NoServedModel: the listing failed, is empty, or lacks `wanted`; `got` is a one-line reason.
    """
    listing_url = redact(str(client.base_url).rstrip("/")) + "/models"
    expected = f"an OpenAI-compatible server answering {listing_url}"
    try:
        listing = await client.models.list(**({} if timeout_s is None else {"timeout": timeout_s}))
    except openai.APIError as exc:
        raise NoServedModel("cannot list the endpoint's models", got=classify(exc).reason, expected=expected,
                            fix="check the URL and that the server is up; pass --model if listing is disabled") from exc
    served = [m.id for m in listing.data]
    if not served:
        raise NoServedModel("the endpoint serves no model", got="the server lists no models", expected=expected,
                            fix="check the server's model, or pass --model NAME")
    if wanted is not None and wanted not in served:
        raise NoServedModel(f"the endpoint does not serve {wanted!r}",
                            got=f"model {wanted!r} not served here (serves {served})", expected=expected,
                            fix=f"pass --model with one of {served}, or serve {wanted!r} there")
    return wanted or served[0]
