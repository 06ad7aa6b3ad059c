"""One collective step: each rank computes, the coordinator decides, and every rank gets its
answer or every rank fails.

    answer = coordinate(group, mine, error, decide, failed)

Every rank sends its message (``mine``) or the error it met computing it. The coordinator, if
no rank failed, calls ``decide`` with every rank's message (in rank order) and sends each rank
its answer. If any rank failed, or ``decide`` raised, every rank instead gets one failure
message (``failed`` phrases it from "rank r: why" lines) and raises RankFailedError with it
and the failing ranks' error kinds (its ``kinds``: class names, which a caller tells apart);
a rank that died or hung (the group's deadlines) is phrased the same way on every live rank;
a rank that brought its own error gets None back and raises that error itself; a coordinator
whose ``decide`` raised raises that. So a step never leaves a rank waiting and never lets one
rank go on while another stops. Save planning, the commit and the load's key and outcome steps
are all this one step (DCP's reduce_scatter / all_reduce play the same part).

Owns: the envelope (one tag byte, then the payload) and the failure rules. Does not own: what
the messages say (wire.py, collective.py) or moving bytes (dist.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ckptio.distributed.dist import Group
from ckptio.errors import RankFailedError

__all__ = ["coordinate", "describe", "listed", "rank_named"]

_OK, _ERROR, _FAILED = b"O", b"E", b"F"

Decide = Callable[[list[bytes]], list[bytes]]
Phrase = Callable[[list[str]], str]


def describe(error: BaseException | None) -> str:
    """An error as one line for the other ranks."""
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"


def coordinate(group: Group, mine: bytes | None, error: BaseException | None, decide: Decide,
               failed: Phrase) -> bytes | None:
    """This rank's answer; None if this rank brought ``error`` (the caller raises it). Raises
    RankFailedError when another rank failed, or the coordinator's own error from ``decide``."""
    if group.size == 1:
        return None if error is not None else decide([_payload(mine)])[0]
    sent = (_ERROR + type(error).__name__.encode() + b"\n" + describe(error).encode()
            if error is not None else _OK + _payload(mine))
    try:
        gathered = group.gather(sent)
        answers: list[bytes] | None = None
        own: BaseException | None = None
        if gathered is not None:
            answers, own = _decide_all(gathered, decide, failed, group.members)
        answer = group.scatter(answers)
    except RankFailedError as lost:  # a rank died or hung (storegroup.py): say what failed
        if error is not None:
            return None  # this rank's own error is what its caller raises
        if getattr(lost, "earlier", False):  # the group failed before this step began
            raise
        raise RankFailedError(failed([str(lost)]), lost.ranks) from None
    if own is not None:
        raise own
    if error is not None:
        return None
    if answer[:1] == _FAILED:
        kinds, _, message = answer[1:].partition(b"\n")
        raise RankFailedError(message.decode(errors="replace"),
                              kinds=tuple(kinds.decode(errors="replace").split(",")))
    return answer[1:]


def _payload(mine: bytes | None) -> bytes:
    if mine is None:
        raise TypeError("coordinate(): a rank with no error must send a message")  # internal
    return mine


def _decide_all(gathered: list[bytes], decide: Decide, failed: Phrase,
                members: tuple[int, ...]) -> tuple[list[bytes], BaseException | None]:
    """On the coordinator: every rank's answer, and the error ``decide`` raised (if any)."""
    reported = [(rank, *message[1:].partition(b"\n")[::2])
                for rank, message in enumerate(gathered) if message[:1] != _OK]
    if reported:
        why = failed([f"{rank_named(rank, members)}: {line.decode(errors='replace')}"
                      for rank, _, line in reported])
        return [_failure([kind for _, kind, _ in reported], why)] * len(gathered), None
    try:
        answers = decide([message[1:] for message in gathered])
    except BaseException as exc:  # noqa: BLE001 - raised by the caller once the peers know
        why = failed([f"the coordinator (rank 0): {describe(exc)}"])
        return [_failure([type(exc).__name__.encode()], why)] * len(gathered), exc
    return [_OK + answer for answer in answers], None


def _failure(kinds: list[bytes], why: str) -> bytes:
    """The failed step's answer: the failing ranks' error kinds, a line break, the message."""
    return _FAILED + b",".join(kinds) + b"\n" + why.encode()


def listed(failures: list[str], limit: int = 8) -> str:
    """'rank 1: why; rank 3: why ...' with at most ``limit`` entries."""
    return "; ".join(failures[:limit]) + (" ..." if len(failures) > limit else "")


def rank_named(rank: int, members: tuple[int, ...]) -> str:
    """'rank r' for group rank ``rank`` of a group of global ranks ``members``, its global rank
    added where it differs ('rank 0 (global rank 2)')."""
    known = members[rank] if 0 <= rank < len(members) else rank
    return f"rank {rank}" + ("" if known == rank else f" (global rank {known})")
