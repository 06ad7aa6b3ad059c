"""The collective steps of an in-place load with peers: the manifest step, the key step and the
final agreement.

SharedManifest: the committed manifest read (and its data files checked) by the coordinator
alone, its bytes broadcast to the others (Options.broadcast_replicated); where the coordinator
could not read one (a foreign format, an error of its own) or a rank has the option off, that
rank (the coordinator: each) reads for itself. The step runs whatever the option, so that
ranks given different values still take the same steps.
UnexpectedKeys: a checkpoint key that one rank's state lacks is unexpected only if no rank asks
for it (carried by the read step where the load has one, readshare.py; else a step of its own).
agree_loaded(): at the end of a load, a failure on any rank raises on every rank.

Owns: these two steps' messages. Does not own: the transport and the failure rules
(step.py, dist.py), what a load reads (loading/).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

from ckptio.distributed import wire
from ckptio.distributed.dist import Group
from ckptio.distributed.step import coordinate, listed
from ckptio.errors import CkptError, RankFailedError
from ckptio.storage.select import compared

__all__ = ["SharedManifest", "UnexpectedKeys", "agree_loaded", "nobody_asks"]

Then = Callable[[tuple[str, ...]], None]  # what the load does with its agreed unexpected keys
_SENT, _READ_YOURSELF = b"M", b"-"  # the manifest step's tag: its bytes follow, or none


class SharedManifest:
    """The manifest step: every rank runs it exactly once, at the open of a load's committed
    manifest (``__call__``), at the open of a file (``skip``), or with the error it met before
    (``fail``). The coordinator goes on once every
    rank has the bytes (the group's broadcast): the step is a barrier at the load's start.
    ``share`` (Options.broadcast_replicated) False: this rank reads its own manifest."""

    def __init__(self, group: Group, path: str, share: bool = True, keys: object = None) -> None:
        # compared between ranks: a local path as an absolute one ("ck", "./ck/" alike), and
        # the keys= selection where it is a key or a collection of keys (a callable is not)
        self.path, self.keys = compared(path), _selection(keys)
        self.group, self.pending, self.share = group, True, share

    def __call__(self, produce: Callable[[], bytes]) -> bytes | None:
        """The manifest's bytes: ``produce()``'s on the coordinator (its error raised there
        once the others know to read for themselves), the coordinator's elsewhere; None: read
        it yourself (the coordinator could not, or the group failed: the load's later steps
        name the rank)."""
        self.pending = False
        if self.group.rank != 0:
            try:
                got = self.group.broadcast(None)
            except RankFailedError:
                return None
            if got[:1] != _SENT:
                if len(got) > 1:  # the coordinator's option is off: its path still compared
                    self._same_path(got[1:])
                return None
            raw = self._same_path(got[1:])
            return raw if self.share else None
        if not self.share:  # the option off here: each rank reads its own, the step still run
            with contextlib.suppress(RankFailedError):  # a lost rank: the load's later steps
                self.group.broadcast(_READ_YOURSELF + self._located(b""))
            return None
        try:
            raw = produce()
        except BaseException:
            self._read_yourself()
            raise
        self.group.broadcast(_SENT + self._located(raw))
        return raw

    def _located(self, body: bytes) -> bytes:
        """``body`` led by what the ranks compare: the path and the keys= selection."""
        return wire.with_location(json.dumps([self.path, self.keys]), body)

    def _same_path(self, sent: bytes) -> bytes:
        """The coordinator's manifest, if it read the checkpoint this rank loads; else
        CkptError (its manifest names files of another checkpoint)."""
        location, raw = wire.split_location(sent)
        theirs, keys = json.loads(location)
        if theirs != self.path:
            raise CkptError(
                f"ranks disagree on the checkpoint: rank {self.group.rank} loads {self.path}, "
                f"rank 0 loads {theirs}. A collective load is of one checkpoint: pass the same "
                "path on every rank (with CheckpointManager.restore, the same step), or a "
                "process_group= of the ranks that share each path")
        if keys is not None and self.keys is not None and keys != self.keys:
            raise CkptError(
                f"ranks disagree on keys= loading {self.path}: rank {self.group.rank} selects "
                f"{self.keys}, rank 0 selects {keys}. A tensor sharded over ranks would be "
                "loaded on some of them only: pass the same keys= on every rank")
        return raw

    def held(self) -> None:
        """This rank has the committed manifest already (the caller read it for this load): it
        takes its part reading nothing, and its path is still compared with the coordinator's."""
        self.share = False
        self(lambda: b"")

    def skip(self) -> None:
        """This rank's load opens no committed manifest (a file): it still takes its part, so
        a rank whose path names something else never leaves the others waiting."""
        self.fail(None)

    def fail(self, error: BaseException | None) -> None:
        """This rank failed before the step (``error``) or skips it: the others read for
        themselves (and learn of a failure at the load's next step)."""
        if self.pending:
            self.pending = False
            if self.group.rank == 0:
                self._read_yourself()
            else:
                with contextlib.suppress(RankFailedError):
                    self.group.broadcast(None)

    def _read_yourself(self) -> None:
        with contextlib.suppress(RankFailedError):  # this rank's own error is what it raises
            self.group.broadcast(_READ_YOURSELF)


def _selection(keys: object) -> list[str] | None:
    """``keys=`` as compared between ranks: its keys, sorted; None (not compared) for a
    callable or another iterable (reading a generator would use it up)."""
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, (list, tuple, set, frozenset)) and all(isinstance(k, str) for k in keys):
        return sorted(keys)
    return None


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
    own unexpected keys (``__call__``), or with its error if it failed before (``fail``).
    ``rides``: the load's read step carries it (readshare.py: one collective for both, its
    answer handed back through ``agreed`` before any read); else it is a collective of its own."""

    def __init__(self, group: Group, path: str, rides: bool = False) -> None:
        self.group, self.path, self.done, self.rides = group, path, False, rides
        self.held: tuple[tuple[str, ...], Then] | None = None

    def __call__(self, mine: tuple[str, ...], then: Then) -> None:
        """Hand the keys no rank asks for, of ``mine``, to ``then`` (now, or once agreed)."""
        self.done = True
        if self.rides:
            self.held = (mine, then)
            return
        answer = coordinate(self.group, json.dumps(list(mine)).encode(), None, _nobody_asks,
                            self._failed)
        nobody = set(json.loads(answer or b"[]"))
        then(tuple(k for k in mine if k in nobody))

    def message(self) -> list[str]:
        """This rank's unexpected keys, for the step that carries them."""
        return list(self.held[0]) if self.held is not None else []

    def agreed(self, nobody: list[str] | None) -> None:
        """The carrying step's answer: the keys no rank asks for (None: the step failed on
        another rank, which the load's last step names; this rank counts none unexpected)."""
        if self.held is not None:
            (mine, then), self.held = self.held, None
            then(tuple(k for k in mine if k in set(nobody or ())))

    def fail(self, error: BaseException) -> None:
        if not self.done and not self.rides:  # riding, the read step carries the error
            self.done = True
            coordinate(self.group, None, error, _nobody_asks, self._failed)

    def _failed(self, failures: list[str]) -> str:
        return f"load of {self.path} failed on {listed(failures)}"


def nobody_asks(unexpected: list[list[str]]) -> list[str]:
    """The keys every rank found unexpected."""
    nobody: set[str] | None = None
    for keys in unexpected:
        nobody = set(keys) if nobody is None else nobody & set(keys)
    return sorted(nobody or ())


def _nobody_asks(messages: list[bytes]) -> list[bytes]:
    """On the coordinator: the keys every rank found unexpected, for every rank."""
    nobody = nobody_asks([json.loads(m) for m in messages])
    return [json.dumps(nobody).encode()] * len(messages)
