"""The collective steps of an in-place load with peers: the key step and the final agreement.

UnexpectedKeys: a checkpoint key that one rank's state lacks is unexpected only if no rank asks
for it. agree_loaded(): at the end of a load, a failure on any rank raises on every rank.

Owns: these two steps' messages. Does not own: the transport and the failure rules
(step.py, dist.py), what a load reads (loading/).
"""

from __future__ import annotations

import json

from ckptio.distributed.dist import Group
from ckptio.distributed.step import coordinate, listed

__all__ = ["UnexpectedKeys", "agree_loaded"]


def agree_loaded(group: Group, error: BaseException | None, path: str) -> None:
    """Collective step, at the end of a load: if any other rank failed, raise here too (this
    rank's own error is raised by the caller)."""
    coordinate(group, b"", error, lambda messages: [b""] * len(messages),
               lambda failures: f"load of {path} failed on {listed(failures)}; this rank's "
               "state may be partly loaded: load again once the cause is fixed")


class UnexpectedKeys:
    """The key step of an in-place load with peers: a checkpoint key that this rank's state
    lacks is unexpected only if no rank asks for it (ranks may hold different keys: per-rank
    values under distinct names, pipeline stages). Every rank runs it exactly once: with its
    own unexpected keys (``__call__``), or with its error if it failed before (``fail``)."""

    def __init__(self, group: Group, path: str) -> None:
        self.group, self.path, self.done = group, path, False

    def __call__(self, mine: tuple[str, ...]) -> tuple[str, ...]:
        self.done = True
        answer = coordinate(self.group, json.dumps(list(mine)).encode(), None, _nobody_asks,
                            self._failed)
        nobody = set(json.loads(answer or b"[]"))
        return tuple(k for k in mine if k in nobody)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            coordinate(self.group, None, error, _nobody_asks, self._failed)

    def _failed(self, failures: list[str]) -> str:
        return f"load of {self.path} failed on {listed(failures)}"


def _nobody_asks(messages: list[bytes]) -> list[bytes]:
    """On the coordinator: the keys every rank found unexpected, for every rank."""
    nobody: set[str] | None = None
    for message in messages:
        keys = set(json.loads(message))
        nobody = keys if nobody is None else nobody & keys
    return [json.dumps(sorted(nobody or ())).encode()] * len(messages)
