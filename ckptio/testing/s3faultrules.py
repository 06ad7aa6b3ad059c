"""The faults a FaultProxy (s3proxy.py) injects, as data: which requests a rule applies to
(Match, by method, operation, key, part number, upload id and query) and what it does to them
(Rule: fail, reset, drop or cut the answer, swallow, delay, call back), with how many times it
fires and how often it has.

Call order: FaultProxy's rule methods (fail, reset, ...) make a Rule and add it; the proxy's
rules_for picks the rules that fire for each request; its relays (s3relay.py) act on them.

Owns: the rules' fields and matching. Does not own: choosing among rules (s3proxy.py), acting
on them (s3relay.py), parsing requests (s3wire.py). Test support only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckptio.testing.s3wire import Request

__all__ = ["Match", "Rule"]


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
