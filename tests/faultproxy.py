"""A fault-injecting HTTP reverse proxy for tests, in front of a real server.

Every chat-completion request is either passed through to the real server (the answer comes from the
engine) or meets one fault taken from the proxy's plan:

- `reset`: the request goes upstream, part of the real response comes back, then the connection is
  reset (TCP RST);
- `429`, `500`, `503`, `400`: that status with a JSON error body and `Retry-After: <retry_after>`;
- `stall`: the proxy reads the request and never answers (the client's timeout has to fire).

`refuse()` closes the listening socket (connections are refused) and `listen()` opens it again on
the same port. Other paths (`/models`, `/health`) always pass through. The proxy runs its own event
loop in a daemon thread, so tests drive it from plain synchronous code.

    proxy = FaultProxy("127.0.0.1", 8000).start()
    proxy.plan(["reset", "429", "pass", "stall"])
    ... requests to proxy.url ...
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

STATUS_FAULTS = {"400": "Bad Request", "429": "Too Many Requests", "500": "Internal Server Error",
                 "503": "Service Unavailable"}
FAULTS = ("pass", "reset", "stall", *STATUS_FAULTS)
STALL_S = 3600.0  # a stall lasts until the client gives up and closes the connection


@dataclass(frozen=True)
class Seen:
    """One request as the proxy received it, and what it did with it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    fault: str

    def json(self) -> dict:
        return json.loads(self.body)


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0, retry_after: str = "1"):
        self.upstream = (upstream_host, upstream_port)
        self.port = port
        self.retry_after = retry_after
        self.seen: list[Seen] = []
        self.faults: Counter = Counter()
        self.default = "pass"
        self._plan: deque[str] = deque()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="faultproxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- control, from the test's thread -------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self.listen()
        return self

    def plan(self, faults: Iterable[str], default: str = "pass") -> None:
        """Faults for the next chat-completion requests, in order; then `default` for the rest."""
        faults = list(faults)
        unknown = [f for f in [*faults, default] if f not in FAULTS]
        assert not unknown, f"unknown faults {unknown}; known: {FAULTS}"
        self._plan.clear()
        self._plan.extend(faults)
        self.default = default

    def listen(self) -> None:
        self._call(self._listen())

    def refuse(self) -> None:
        """Stop accepting connections: new ones are refused; exchanges under way finish."""
        self._call(self._refuse())

    def stop(self) -> None:
        """Refuse new connections, cut the ones under way, stop the loop."""
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def chat_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/chat/completions")]

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- the proxy, in its own loop ------------------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _shutdown(self) -> None:
        await self._refuse()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            chat = path.endswith("/chat/completions")
            fault = (self._plan.popleft() if self._plan else self.default) if chat else "pass"
            self.seen.append(Seen(method, path, headers, body, fault))
            self.faults[fault] += 1
            if fault in STATUS_FAULTS:
                await self._answer_status(writer, int(fault), STATUS_FAULTS[fault])
            elif fault == "stall":
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(reader.read(), STALL_S)  # returns when the client hangs up
            else:
                await self._forward(lines, body, writer, reset=fault == "reset")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _answer_status(self, writer: asyncio.StreamWriter, status: int, text: str) -> None:
        body = json.dumps({"error": {"message": f"injected {status} by faultproxy", "type": text,
                                     "code": status}}).encode()
        writer.write(f"HTTP/1.1 {status} {text}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Retry-After: {self.retry_after}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async def _forward(self, lines: list[str], body: bytes, writer: asyncio.StreamWriter, reset: bool) -> None:
        """Send the request upstream with `Connection: close` and copy the answer back; with `reset`,
        copy only the head and part of the body, then reset the connection."""
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        kept = [ln for ln in lines[1:] if ln and ln.split(":", 1)[0].strip().lower() not in ("connection", "keep-alive")]
        up_writer.write(("\r\n".join([lines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1") + body)
        await up_writer.drain()
        try:
            if reset:
                head = await up_reader.readuntil(b"\r\n\r\n")
                part = await up_reader.read(16)
                writer.write(head + part)
                await writer.drain()
                await asyncio.sleep(0.05)  # let the partial answer leave before the reset
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()
