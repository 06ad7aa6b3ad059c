"""A rank's part of a restore's transfers that failed: said where the ranks meet next.

Call order (rebuild.py, regrow.py): a rank whose sends, receives or install fail does not
raise at once, as the others wait for it in the gather after the transfers (up to
step_timeout_s): unless ``peer_gone`` (a peer died or froze: that gather would wait for the
peer, so the caller raises and names it), it puts ``said(rank, exc)`` among its part of that
gather; after it, every rank calls ``raise_said`` with what the ranks said (``said_by``) and
raises the same RankFailedError, naming each rank's error.

Owns: the item's name (``LEFT``) and the message. Does not own: the gathers, the transfers,
the ranks' liveness (distributed/dist.py silent_ranks).
"""

from __future__ import annotations

from typing import Any

from ckptio.distributed.dist import silent_ranks
from ckptio.errors import RankFailedError

__all__ = ["peer_gone", "raise_said", "said", "said_by"]

LEFT = "left:r"  # + a rank: its part failed (an item of the gather after the transfers)


def peer_gone(ctx: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is torch's error of a transfer with a peer that stopped beating (raise
    it: the gather after the transfers would wait for that peer)."""
    return isinstance(exc, RuntimeError) and bool(
        silent_ranks(ctx.topology.others(ctx.rank), ctx.transfers))


def said(rank: int, exc: BaseException) -> dict[str, str]:
    """The item that says ``rank``'s part failed with ``exc``."""
    return {f"{LEFT}{rank}": f"{type(exc).__name__}: {exc}"}


def said_by(gathered: dict[str, str]) -> dict[int, str]:
    """{rank: its error} of the ranks whose items in ``gathered`` say their part failed."""
    return {int(item[len(LEFT):]): why for item, why in gathered.items()
            if item.startswith(LEFT)}


def raise_said(ctx: Any, errors: dict[int, str], what: str, transfers: Any = None) -> None:
    """RankFailedError, alike on every rank, where ``errors`` (rank -> its error) names any:
    ``what`` failed on those ranks; with ``transfers`` (the group of the transfers it
    failed in) also the ranks that stopped beating."""
    if not errors:
        return
    gone = [] if transfers is None else silent_ranks(ctx.topology.others(ctx.rank), transfers)
    why = "" if transfers is None else (
        f" (in its transfers: {ctx.topology.name_ranks(gone) or 'a rank it exchanges with'} "
        "died, failed its part, or gave no answer within peer_timeout_s)")
    raise RankFailedError(
        f"rank {ctx.rank}: {what} failed on "
        f"{'; '.join(f'rank {r}: {e}' for r, e in sorted(errors.items()))}{why}; nothing was "
        "loaded and everything in memory is kept: fix that error, or restart the job",
        tuple(gone))
