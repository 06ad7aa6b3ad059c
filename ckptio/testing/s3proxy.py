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

Owns: listening, per-request counters (thread-safe), the rule table and which rules fire. Does
not own: the rules' fields (testing/s3faultrules.py), relaying a connection and acting on its
faults (testing/s3relay.py), HTTP parsing and operation names (testing/s3wire.py), the server
(testing/s3server.py), retries or error mapping (ckptio/storage/s3/client.py). Test support only.
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ckptio.testing.s3faultrules import Match, Rule
from ckptio.testing.s3relay import Relay
from ckptio.testing.s3wire import Request, parse_request, range_nbytes

__all__ = ["FaultProxy", "Match", "Request", "Rule"]


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
        self._connections: set[Relay] = set()
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
            conn = Relay(self, client)
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=conn.serve, daemon=True, name="s3proxy-requests").start()

    def forget(self, conn: Relay) -> None:
        """``conn`` has closed."""
        with self._lock:
            self._connections.discard(conn)
