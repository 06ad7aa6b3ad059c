"""One client connection of a FaultProxy (s3proxy.py) relayed to its own server connection,
bytes verbatim, with the proxy's faults acted on as they fire: a request delayed, called back,
failed with an S3 error, swallowed or cut off with a reset; an answer dropped or cut off.

Call order: the proxy's accept thread makes a Relay per client connection and runs ``serve``
on a thread of its own; ``serve`` reads requests on that thread, connects to the server at the
first request to forward and relays answers on a second; ``close`` (its own end, or the
proxy's stop) closes both sockets and tells the proxy (``forget``).

Owns: a connection's sockets, the requests awaiting an answer, acting on a rule. Does not own:
which rules fire (the proxy's ``rules_for``, RelayOwner), the counters, HTTP parsing
(s3wire.py). Test support only.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from ckptio.testing.s3faultrules import Rule
from ckptio.testing.s3wire import Request, Stream, parse_head, range_nbytes

__all__ = ["Relay", "RelayOwner"]

_MESSAGES = {"SlowDown": "Please reduce your request rate.",
             "InternalError": "We encountered an internal error. Please try again.",
             "ServiceUnavailable": "Service is unable to handle request."}


class RelayOwner(Protocol):
    """What a Relay needs of the proxy that made it (FaultProxy)."""

    target: tuple[str, int]  # the server's (host, port)
    errors: list[BaseException]  # bugs met in the relays' threads (should be none)

    def record_request(self, head: bytes) -> Request: ...

    def count_range_bytes(self, n: int) -> None: ...

    def rules_for(self, req: Request) -> tuple[list[Rule], Rule | None]: ...

    def forget(self, conn: Relay) -> None: ...


class _Reset(Exception):
    """A ``reset`` rule fired: both connections are to end with RST."""


class Relay:
    """One client connection and its own server connection; requests read on the thread that
    serves it, answers relayed by a second thread."""

    def __init__(self, proxy: RelayOwner, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.pending: deque[tuple[Request, Rule | None]] = deque()  # (request, its answer's rule)
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.closed = False

    def serve(self) -> None:
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._guard(self._requests)

    def _server(self) -> socket.socket:
        """The server connection, made at the first request to forward: a connection whose
        requests the proxy answers itself holds none, since a server serving one connection at
        a time (the GCS emulator) would wait on it and leave every other client unanswered."""
        if self.upstream is not None:
            return self.upstream
        try:
            upstream = socket.create_connection(self.proxy.target, timeout=5)
        except OSError:  # the server is down: the client sees its connection reset
            raise _Reset from None
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            if self.closed:  # the proxy stopped meanwhile
                upstream.close()
                raise OSError("the relay closed")
            self.upstream = upstream
        threading.Thread(target=self._guard, args=(self._answers,), daemon=True,
                         name="s3proxy-answers").start()
        return upstream

    def _guard(self, work: Callable[[], None]) -> None:
        try:
            work()
        except _Reset:
            self.close(rst=True)
        except OSError:  # a peer went away (ConnectionError is an OSError): end this connection
            pass
        except Exception as exc:
            self.proxy.errors.append(exc)
            raise
        finally:
            self.close()

    def _requests(self) -> None:
        reader = Stream(self.client)
        while (head := reader.head()) is not None:
            req = self.proxy.record_request(head)
            pre, rule = self.proxy.rules_for(req)
            for r in pre:
                if r.kind == "delay":
                    time.sleep(r.seconds)
                elif r.callback is not None:
                    r.callback(req)
            length = req.headers.get("content-length", "0")
            if rule is not None and rule.kind == "black_hole":  # read, never forwarded
                for _ in reader.body(req.headers, length):
                    pass
                continue
            if rule is not None and rule.kind == "fail":
                if not self._fail(req, reader, rule, length):
                    return
                continue
            left = rule.after_bytes if rule is not None and rule.kind == "reset" else None
            upstream = self._server()
            with self.lock:
                answer_rule = rule if rule is not None and rule.kind.endswith("_response") else None
                self.pending.append((req, answer_rule))
            for piece in self._chain(head, reader.body(req.headers, length)):
                if left is not None and len(piece) >= left:
                    upstream.sendall(piece[:left])
                    raise _Reset
                if left is not None:
                    left -= len(piece)
                upstream.sendall(piece)
            if left is not None:
                raise _Reset

    @staticmethod
    def _chain(head: bytes, body: Iterator[bytes]) -> Iterator[bytes]:
        yield head
        yield from body

    def _fail(self, req: Request, reader: Stream, rule: Rule, length: str) -> bool:
        """Answer with an S3 error, forwarding nothing; False when the connection must end."""
        expect = req.headers.get("expect", "").lower() == "100-continue"
        if not expect:  # read the body first, so the connection stays usable
            for _ in reader.body(req.headers, length):
                pass
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{escape(rule.code)}</Code>'
                f"<Message>{escape(rule.message or _MESSAGES.get(rule.code, rule.code))}</Message>"
                f"<Resource>{escape(urlsplit(req.target).path)}</Resource>"
                f"<RequestId>ckptio-proxy-{id(req):x}</RequestId></Error>").encode()
        reason = next((s.phrase for s in HTTPStatus if s.value == rule.status), "")
        head = (f"HTTP/1.1 {rule.status} {reason}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nDate: {formatdate(usegmt=True)}\r\n"
                f"Server: ckptio-fault-proxy\r\n" + ("Connection: close\r\n" if expect else "")
                + "\r\n").encode()
        req.status = rule.status
        self._to_client(head + (b"" if req.method == "HEAD" else body))
        if not expect:
            return True
        # the client may send the body anyway: let it, so closing does not reset the answer
        self.client.shutdown(socket.SHUT_WR)
        self.client.settimeout(5)
        for _ in reader.rest():
            pass
        return False

    def _answers(self) -> None:
        assert self.upstream is not None
        reader = Stream(self.upstream)
        while (head := reader.head()) is not None:
            (_, status_text, *_), headers = parse_head(head)
            status = int(status_text)
            if 100 <= status < 200:  # 100 Continue: pass it on, the final answer follows
                self._to_client(head)
                continue
            with self.lock:
                req, rule = self.pending.popleft() if self.pending else (None, None)
            if req is not None:
                req.status = status
                if status == 206 and req.range and range_nbytes(req.range) is None:
                    self.proxy.count_range_bytes(int(headers.get("content-length", "0")))
            if rule is not None and rule.kind == "drop_response":
                return  # the server has acted; the client never hears of it
            self._to_client(head)
            if (req is not None and req.method == "HEAD") or status in (204, 304):
                continue  # no body, whatever the head says
            length = headers.get("content-length")
            left = rule.after_bytes if rule is not None else None  # cut_response
            for piece in reader.body(headers, length):
                if left is not None and len(piece) >= left:
                    self._to_client(piece[:left])
                    raise _Reset
                if left is not None:
                    left -= len(piece)
                self._to_client(piece)
            if left is not None:
                raise _Reset
            if length is None and "chunked" not in headers.get("transfer-encoding", "").lower():
                return  # the body ended with the connection

    def _to_client(self, data: bytes) -> None:
        with self.write_lock:
            self.client.sendall(data)

    def close(self, rst: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            try:
                if rst:  # SO_LINGER 0: close() sends RST; SHUT_RD wakes a thread in recv()
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RD)
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already disconnected
                pass
            sock.close()
        self.proxy.forget(self)
