"""The bytes of read-once units moving from the rank that read them to the ranks that want them.

Every rank posts all its receives and sends at once (the gloo group's own send and recv: tensors
only, nothing pickled), over a gloo process group of the load's own (wiregroup.py) whose timeout
(Options.rank_timeout_s) bounds every wait. A message is a slice of one unit's destination where
it is a contiguous host tensor (no copy on either side), else a buffer its pieces are packed
into or copied out of. Each received unit is checked against the checksum the manifest records
for it before it is copied on; a mismatch is a CorruptCheckpointError naming the key, the file
and the sending rank. A peer that dies, or does not answer within the timeout, fails its
messages only (its others are not waited for: one timeout per peer): ``exchange`` names it, and
the caller reads that peer's units from storage.

Owns: posting, waiting, landing the bytes, checking them. Does not own: who sends what
(planning/shared_reads.py), the steps around it and the fallback (readshare.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import CorruptCheckpointError
from ckptio.format.checksum import entry_checksum
from ckptio.format.types import TensorEntry
from ckptio.planning.shared_reads import Piece, Share, messages

__all__ = ["Unit", "exchange", "host_bytes"]


@dataclass
class Unit:
    """A stored entry this rank reads whole, into each of ``dests`` (the stored dtype)."""

    name: str
    entry: TensorEntry
    dests: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Post:
    """One posted message: the ``tag``-th to or from ``peer``, in ``buffer``; ``pieces`` (unit
    index, lo, hi) to copy out of it once received (None: it is the destination itself)."""

    peer: int
    send: bool
    buffer: torch.Tensor
    pieces: list[Piece] | None
    tag: int = 0


def host_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """The bytes of ``t`` as a flat uint8 view, where ``t`` is a contiguous host tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


def exchange(group: Any, units: list[Unit], share: Share, algorithm: str | None,
             block_nbytes: int, where: Callable[[str], str],
             who: Callable[[int], str] = "rank {}".format) -> dict[int, str]:
    """Send the units this rank owns (read, in their first destination) to the ranks that want
    them and receive the others into their destinations, checked against ``algorithm``'s
    checksums (None: unchecked; ``where`` names a file, ``who`` a peer in its errors). -> the
    peers some of whose messages failed, with why: every unit from such a peer is to be read
    again."""
    incoming: dict[int, list[int]] = {}
    outgoing: dict[int, list[int]] = {}
    for i, owner in enumerate(share.owner):
        if owner != -1:
            incoming.setdefault(owner, []).append(i)
    for i, receivers in share.to.items():
        for r in receivers:
            outgoing.setdefault(r, []).append(i)
    landings = {i: _landing(units[i]) for idx in incoming.values() for i in idx}
    sources: dict[int, torch.Tensor] = {}
    posts: list[_Post] = []
    for owner, idx in sorted(incoming.items()):
        idx.sort(key=lambda i: units[i].name)
        for tag, pieces in enumerate(messages([units[i].entry.nbytes for i in idx])):
            posts.append(_receive(owner, [(idx[k], lo, hi) for k, lo, hi in pieces], landings,
                                  tag))
    for receiver, idx in sorted(outgoing.items()):
        idx.sort(key=lambda i: units[i].name)
        for i in idx:
            sources.setdefault(i, _source(units[i]))
        for tag, pieces in enumerate(messages([units[i].entry.nbytes for i in idx])):
            posts.append(_Post(receiver, True, _send_buffer(
                sources, [(idx[k], lo, hi) for k, lo, hi in pieces]), None, tag))
    failed = _run(group, posts, landings)
    for owner, idx in incoming.items():
        if owner not in failed:
            for i in idx:
                _check(units[i], landings[i], algorithm, block_nbytes, who(owner), where)
                _land(units[i], landings[i])
    return failed


def _landing(unit: Unit) -> torch.Tensor:
    """Where a received unit's bytes go: its first destination's bytes, else a buffer."""
    direct = host_bytes(unit.dests[0])
    if direct is not None and direct.numel() == unit.entry.nbytes:
        return direct
    return torch.empty(unit.entry.nbytes, dtype=torch.uint8)


def _source(unit: Unit) -> torch.Tensor:
    """An owned unit's bytes, as read into its first destination."""
    direct = host_bytes(unit.dests[0])
    if direct is not None:
        return direct
    copy = unit.dests[0].detach().to("cpu", copy=True).contiguous()
    return copy.reshape(-1).view(torch.uint8)


def _receive(owner: int, pieces: list[Piece], landings: dict[int, torch.Tensor],
             tag: int) -> _Post:
    if len(pieces) == 1:  # straight into the destination's bytes
        i, lo, hi = pieces[0]
        return _Post(owner, False, landings[i][lo:hi], None, tag)
    nbytes = sum(hi - lo for _i, lo, hi in pieces)
    return _Post(owner, False, torch.empty(nbytes, dtype=torch.uint8), pieces, tag)


def _send_buffer(sources: dict[int, torch.Tensor], pieces: list[Piece]) -> torch.Tensor:
    """The bytes of one outgoing message."""
    if len(pieces) == 1:
        i, lo, hi = pieces[0]
        return sources[i][lo:hi]
    return torch.cat([sources[i][lo:hi] for i, lo, hi in pieces])


def _run(group: Any, posts: list[_Post], landings: dict[int, torch.Tensor]) -> dict[int, str]:
    """Post every message, wait for each (the group's timeout bounds each wait), and copy the
    packed ones out. A peer whose message failed is not waited for again: a frozen peer costs
    the exchange one timeout, whatever the number of its messages. -> failed peers, with why."""
    failed: dict[int, str] = {}
    if not posts:
        return failed
    try:
        works = _post(group, posts)
    except RuntimeError as exc:  # a peer already gone: nothing was posted to anyone
        return {p.peer: _why(exc) for p in posts}
    for post, work in zip(posts, works):
        if post.peer in failed:  # given up with its peer: one timeout per peer, not per message
            continue
        try:
            _wait(work)
        except RuntimeError as exc:  # torch.distributed's errors: a peer died or timed out
            failed.setdefault(post.peer, _why(exc))
            continue
        if post.pieces is not None and post.peer not in failed:
            at = 0
            for i, lo, hi in post.pieces:
                landings[i][lo:hi].copy_(post.buffer[at:at + hi - lo])
                at += hi - lo
    return failed


def _post(group: Any, posts: list[_Post]) -> list[Any]:
    """Every message posted on the wire group (gloo's send and recv) -> their works."""
    return [group.send([p.buffer], p.peer, p.tag) if p.send else
            group.recv([p.buffer], p.peer, p.tag) for p in posts]


def _wait(work: Any) -> None:
    work.wait()


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _check(unit: Unit, landing: torch.Tensor, algorithm: str | None, block_nbytes: int,
           owner: str, where: Callable[[str], str]) -> None:
    if algorithm is None:
        return
    entry = unit.entry
    data = landing.numpy().data if landing.numel() else memoryview(b"")
    got = entry_checksum(algorithm, block_nbytes, data)
    if got != entry.checksum:
        raise CorruptCheckpointError(
            f"checksum mismatch for key {entry.key!r} of {where(entry.file)} bytes "
            f"[{entry.offset}, {entry.offset + entry.nbytes}) as received from {owner}, "
            f"which read it for this rank: stored {entry.checksum}, received {got}. The bytes "
            f"were damaged between the ranks ({owner} checked them as it read them); load "
            "again, and if it recurs check the hosts' network and memory, or pass "
            "Options(broadcast_replicated=False) to have every rank read its own copy (this "
            "rank's destination tensors may be partly filled)")


def _land(unit: Unit, landing: torch.Tensor) -> None:
    """A checked unit's bytes into each of its destinations not already holding them."""
    for dest in unit.dests:
        direct = host_bytes(dest)
        if direct is not None and direct.data_ptr() == landing.data_ptr():
            continue
        dest.copy_(landing.view(dest.dtype).view(dest.shape))
