"""A fault-injecting HTTP/1.1 proxy on loopback, to put between an S3 client and a real server.

    with FaultProxy("127.0.0.1", server.port) as proxy:     # clients use proxy.endpoint
        proxy.fail(503, "SlowDown", times=2, op="UploadPart", part_number=3)
        proxy.reset(after_bytes=100_000, op="UploadPart")    # RST mid-body
        proxy.drop_response(op="CompleteMultipartUpload")    # acted on, never answered
        proxy.delay(2.0, op="GetObject")
        proxy.on_request(lambda req: server.kill(), op="UploadPart", part_number=3)
        proxy.black_hole(op="PutObject", key="manifest.json$", partition=True)  # silence
        ...; proxy.counts["UploadPart"], proxy.range_bytes, proxy.requests

Bytes pass VERBATIM in both directions (SigV4 signs the Host header, so nothing is rewritten);
each client connection gets its own server connection (threads, stdlib only). The framing
parsed and the rules' order and match keys: FaultProxy, and docs/BEHAVIOUR.md,
"ckptio.testing.s3proxy".

Owns: forwarding, per-request counters (thread-safe), the faults. Does not own: HTTP parsing and
operation names (testing/s3wire.py), the server (testing/s3server.py), retries or error mapping
(ckptio/storage/s3/client.py). Test support only.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from ckptio.testing.s3wire import Request, Stream, parse_head, parse_request, range_nbytes

__all__ = ["FaultProxy", "Match", "Request", "Rule"]

_MESSAGES = {"SlowDown": "Please reduce your request rate.",
             "InternalError": "We encountered an internal error. Please try again.",
             "ServiceUnavailable": "Service is unable to handle request."}


@dataclass(frozen=True)
class Match:
    """Which requests a rule applies to (match keys: FaultProxy)."""

    method: str | None = None
    op: str | None = None
    key: str | None = None
    part_number: int | None = None
    upload_id: str | bool | None = None
    uploads: bool | None = None
    query: Mapping[str, str | None] | None = None

    def __call__(self, req: Request) -> bool:
        q = req.query
        if isinstance(self.upload_id, bool):
            upload_ok = ("uploadId" in q) is self.upload_id
        else:
            upload_ok = self.upload_id is None or q.get("uploadId") == self.upload_id
        return (upload_ok and (self.method is None or req.method == self.method.upper())
                and (self.op is None or req.op == self.op)
                and (self.key is None or re.search(self.key, req.key) is not None)
                and (self.part_number is None or req.part_number == self.part_number)
                and (self.uploads is None or ("uploads" in q) is self.uploads)
                and all(name in q and (want is None or q[name] == want)
                        for name, want in (self.query or {}).items()))


@dataclass
class Rule:
    """A fault or hook: ``fired`` counts the requests it acted on, ``times`` how many are left
    (None: forever)."""

    kind: str  # "fail", "reset", "drop_response", "cut_response", "black_hole", "delay", ...
    match: Match
    times: int | None
    fired: int = 0
    status: int = 503
    code: str = "SlowDown"
    message: str | None = None
    after_bytes: int = 0
    seconds: float = 0.0
    callback: Callable[[Request], object] | None = None
    partition: bool = False  # black_hole: every later request too, until clear()

    @property
    def terminal(self) -> bool:
        return self.kind in ("fail", "reset", "drop_response", "cut_response", "black_hole")


class _Reset(Exception):
    """A ``reset`` rule fired: both connections are to end with RST."""


class _Connection:
    """One client connection and its own server connection; requests read on the thread that
    serves it, answers relayed by a second thread."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.pending: deque[tuple[Request, Rule | None]] = deque()  # (request, its answer's rule)
        self.lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.closed = False

    def serve(self) -> None:
        try:
            self.upstream = socket.create_connection(self.proxy.target, timeout=5)
        except OSError:  # the server is down: the client sees its connection reset
            self.close(rst=True)
            return
        self.upstream.settimeout(None)
        for sock in (self.client, self.upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._guard, args=(self._answers,), daemon=True,
                         name="s3proxy-answers").start()
        self._guard(self._requests)

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
            with self.lock:
                answer_rule = rule if rule is not None and rule.kind.endswith("_response") else None
                self.pending.append((req, answer_rule))
            assert self.upstream is not None
            for piece in self._chain(head, reader.body(req.headers, length)):
                if left is not None and len(piece) >= left:
                    self.upstream.sendall(piece[:left])
                    raise _Reset
                if left is not None:
                    left -= len(piece)
                self.upstream.sendall(piece)
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


class FaultProxy:
    """Listens on ``host`` (loopback), forwards to ``target_host:target_port``.

    Only heads are parsed, and the framing needed to tell requests apart on a keep-alive
    connection: Content-Length or ``Transfer-Encoding: chunked`` bodies (aws-chunked is a
    Content-Encoding inside a Content-Length body), interim ``100 Continue`` answers to
    ``Expect: 100-continue``, HEAD/204/304 answers without bodies, bodies ending at close.

    Rules are checked in the order added. Every matching ``delay``/``on_request`` rule fires
    (before the request goes on); then the first matching ``fail``/``reset``/``drop_response``
    rule decides its fate. ``times`` is how many matches a rule fires for (None: forever);
    ``Rule.fired`` counts. Match keys (all optional, all must hold): ``method``, ``op``
    (s3wire.operation()), ``key`` (regex searched in the URL-decoded key after the bucket),
    ``part_number``, ``upload_id`` (a value, or True: present), ``uploads`` (True: the
    ``?uploads`` query), ``query`` (name -> value, None = present)."""

    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = 0
        self.counts: Counter[str] = Counter()
        self.range_bytes = 0
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []  # bugs met in the proxy's threads (should be none)
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((self.host, self.port))  # port 0 first; restarting keeps the port
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), daemon=True,
                                        name=f"s3proxy-{self.port}")
        self._thread.start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            listener.close()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- rules ------------------------------------------------------------------------------

    def fail(self, status: int = 503, code: str = "SlowDown", *, times: int | None = 1,
             message: str | None = None, **match: Any) -> Rule:
        """Answer matching requests with an S3 XML error, not forwarding them."""
        return self._add(Rule("fail", Match(**match), times, status=status, code=code,
                              message=message))

    def reset(self, *, times: int | None = 1, after_bytes: int = 0, **match: Any) -> Rule:
        """Forward the first ``after_bytes`` bytes of the request (head, then body), then reset
        both connections (RST). A request shorter than that goes whole, then the reset."""
        return self._add(Rule("reset", Match(**match), times, after_bytes=after_bytes))

    def drop_response(self, *, times: int | None = 1, **match: Any) -> Rule:
        """Forward the request, wait for the server's answer, close the client's connection
        without it."""
        return self._add(Rule("drop_response", Match(**match), times))

    def cut_response(self, *, times: int | None = 1, after_bytes: int = 0, **match: Any) -> Rule:
        """Forward the request and the head of the server's answer and the first
        ``after_bytes`` bytes of its body, then reset both connections (RST)."""
        return self._add(Rule("cut_response", Match(**match), times, after_bytes=after_bytes))

    def black_hole(self, *, times: int | None = None, partition: bool = False,
                   **match: Any) -> Rule:
        """Read matching requests whole and forward nothing, the connection kept open: the
        client hears nothing back, as behind a partition or a stuck load balancer.
        ``partition``: from the first match on, every request is swallowed so (until clear())."""
        return self._add(Rule("black_hole", Match(**match), times, partition=partition))

    def partition(self) -> Rule:
        """Swallow every request from now on (a black hole for all), until clear()."""
        return self.black_hole()

    def delay(self, seconds: float, *, times: int | None = 1, **match: Any) -> Rule:
        return self._add(Rule("delay", Match(**match), times, seconds=seconds))

    def on_request(self, callback: Callable[[Request], object], *, times: int | None = 1,
                   **match: Any) -> Rule:
        """Call ``callback(request)`` on the proxy's thread before forwarding (e.g. to kill the
        server); the request then goes on."""
        return self._add(Rule("on_request", Match(**match), times, callback=callback))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def reset_counters(self) -> None:
        with self._lock:
            self.counts.clear()
            self.range_bytes = 0
            self.requests.clear()

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    # -- for its connections (the proxy's own threads) --------------------------------------

    def record_request(self, head: bytes) -> Request:
        """Count the request whose head is ``head``; -> it, parsed."""
        req = parse_request(head)
        with self._lock:
            self.counts[req.op] += 1
            self.requests.append(req)
            if req.method == "GET" and req.range:
                self.range_bytes += range_nbytes(req.range) or 0
        return req

    def count_range_bytes(self, n: int) -> None:
        """A ranged GET's answer of ``n`` bytes whose range did not say its size."""
        with self._lock:
            self.range_bytes += n

    def rules_for(self, req: Request) -> tuple[list[Rule], Rule | None]:
        """The delay/on_request rules that fire for ``req`` and the fault deciding its fate."""
        pre: list[Rule] = []
        chosen: Rule | None = None
        with self._lock:
            for rule in self._rules:
                if rule.kind == "black_hole" and rule.partition and rule.fired:
                    rule.fired += 1  # the partition has begun: everything is swallowed
                    return [], rule
                if rule.times == 0 or (rule.terminal and chosen is not None) or not rule.match(req):
                    continue
                rule.fired += 1
                if rule.times is not None:
                    rule.times -= 1
                if rule.terminal:
                    chosen = rule
                else:
                    pre.append(rule)
        return pre, chosen

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # stop() closed the listener
                return
            conn = _Connection(self, client)
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=conn.serve, daemon=True, name="s3proxy-requests").start()

    def forget(self, conn: _Connection) -> None:
        """``conn`` has closed."""
        with self._lock:
            self._connections.discard(conn)
