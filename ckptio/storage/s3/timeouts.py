"""How long one S3 request may wait: its deadline, each attempt's read timeout, an outage.

A request (client.call) is retried until ``s3_retry_deadline_s`` after it started. Each attempt
waits for the store's answer (and between the bytes of a body) at most what is left of that
deadline, never less than FLOOR_S nor more than READ_TIMEOUT_S: a network that accepts the
connection and then goes silent fails the request at its deadline, not a fixed timeout later.
The attempt's timeout is set on the request itself (botocore's per-request ``read_timeout``,
put in the request's context by the hook install() registers on the client), from the
thread-local value attempt() sets around it.

Once a request to an endpoint gave up, the endpoint is in an outage until a request to it
succeeds, or WINDOW_S pass with no request giving up (the next save, unless it starts right
after the failure, retries). Requests that start in an outage (a failed save's
cleanup: aborting its uploads, reading the manifest, releasing its lock) share GRACE_S after
the outage's first give-up, then have one attempt of FLOOR_S each: a failed save's cleanup adds
seconds, not a deadline per request. A request that starts after the outage ended, with no
request to the endpoint succeeding since, is a probe: it has PROBE_SHARE of its deadline (at
least FLOOR_S), so a store that stays silent costs each later save (the training loop waits
for its pre-save checks and its claim) that much, not a whole deadline; the first success
ends the record and every request has its whole deadline again.

Owns: Budget (one request's), the outage record, the timeout hook. Does not own: what is
retried, the retry loop and its messages (client.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["FLOOR_S", "GRACE_S", "PROBE_SHARE", "READ_TIMEOUT_S", "WINDOW_S", "Budget", "attempt",
           "ended", "hopeless", "install", "limited", "outage_since", "probed", "recovered", "reset"]

READ_TIMEOUT_S = 120.0  # the longest one attempt waits for an answer
FLOOR_S = 1.0  # the shortest
GRACE_S = 3.0  # what requests that start in an outage share (a failed save's cleanup)
WINDOW_S = 2 * GRACE_S  # an outage lasts this long after its last give-up, unless one succeeds
PROBE_SHARE = 0.1  # of its deadline: a request after an outage, the endpoint silent since

_outage: dict[str, tuple[float, float]] = {}  # endpoint -> (first, last) give-up, no success since
_lock = threading.Lock()
_local = threading.local()  # .read_timeout: the attempt in progress on this thread


def outage_since(endpoint: str) -> tuple[float, float] | None:
    """(first, last) give-up of the outage of ``endpoint`` (time.monotonic()), or None."""
    with _lock:
        return _outage.get(endpoint)


def ended(budget: Budget) -> None:
    """``budget``'s request gave up: an outage begins, or the one it met goes on (its first
    give-up, which the grace counts from, stays)."""
    now = time.monotonic()
    with _lock:
        known = _outage.get(budget.endpoint)
        met = known is not None and known[1] > budget.started - WINDOW_S
        _outage[budget.endpoint] = (known[0] if met and known else now, now)


def recovered(endpoint: str) -> None:
    """A request to ``endpoint`` succeeded: no outage, nor probes after one."""
    if _outage:
        with _lock:
            _outage.pop(endpoint, None)


def reset() -> None:
    """Forget every outage (tests)."""
    with _lock:
        _outage.clear()


def hopeless(endpoint: str) -> bool:
    """Whether ``endpoint`` is in an outage past its grace: a request now would have one short
    attempt only (what cleanup that can wait for the next save skips)."""
    known = outage_since(endpoint)
    now = time.monotonic()
    return known is not None and known[1] > now - WINDOW_S and now >= known[0] + GRACE_S


class Budget:
    """One request's time: it started now; ``end`` is when it gives up at its next failure."""

    def __init__(self, endpoint: str, deadline_s: float) -> None:
        self.endpoint, self.deadline_s = endpoint, deadline_s
        self.started = time.monotonic()
        self.end = self.started + deadline_s
        self.probe = False  # started after an outage, with no success since
        known = outage_since(endpoint)
        if known is not None and known[1] > self.started - WINDOW_S:
            self.end = min(self.end, known[0] + GRACE_S)  # started in an outage
        elif known is not None:
            self.probe = True
            self.end = min(self.end, self.started + max(FLOOR_S, PROBE_SHARE * deadline_s))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def over(self) -> bool:
        """Past its end, or an outage of its endpoint began after it started (or less than a
        WINDOW_S before): the request gives up at its next transient failure."""
        if time.monotonic() >= self.end:
            return True
        known = outage_since(self.endpoint)
        return known is not None and known[1] > self.started - WINDOW_S

    def read_timeout(self) -> float:
        """The next attempt's read timeout: what is left, within [FLOOR_S, READ_TIMEOUT_S]."""
        return max(FLOOR_S, min(READ_TIMEOUT_S, self.left()))


def probed(budget: Budget) -> str:
    """What a give-up message adds when ``budget``'s request was a probe ("" if not)."""
    if not budget.probe:
        return ""
    return (", as no request to it has succeeded since an earlier one gave up (so this one had "
            f"{PROBE_SHARE:.0%} of the deadline)")


@contextlib.contextmanager
def attempt(budget: Budget) -> Iterator[None]:
    """Requests made on this thread inside wait at most ``budget.read_timeout()`` for answers."""
    with limited(budget.read_timeout()):
        yield


@contextlib.contextmanager
def limited(seconds: float) -> Iterator[None]:
    """Requests made on this thread inside wait at most ``seconds`` for answers."""
    outer = getattr(_local, "read_timeout", None)
    _local.read_timeout = seconds if outer is None else min(outer, seconds)
    try:
        yield
    finally:
        _local.read_timeout = outer


def _set_timeout(context: dict[str, Any] | None = None, **_kwargs: Any) -> None:
    """botocore's ``before-call`` event: the thread's attempt timeout onto the request."""
    seconds = getattr(_local, "read_timeout", None)
    if context is not None and seconds is not None:
        context["read_timeout"] = seconds


def install(s3_client: Any) -> None:
    """Every request of ``s3_client`` takes its read timeout from attempt()/limited()."""
    s3_client.meta.events.register("before-call.s3", _set_timeout)
