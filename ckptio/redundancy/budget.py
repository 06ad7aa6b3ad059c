"""A bandwidth budget: bytes per second that one sender may spend, as a token bucket.

    budget = Budget(rate)      # None or 0: unlimited
    budget.spend(nbytes)       # returns when these bytes may go: the time their predecessors
                               # cost at ``rate`` has passed

The protection across hosts (protect.py) spends it before posting each chunk of a transfer, so a
host's ranks together send at most the rate the user gave (Partners/Parity ``rate``), in
chunks of CHUNK bytes. Owns: the clock arithmetic. Does not own: what is sent (protect.py,
peers.py).
"""

from __future__ import annotations

import time

__all__ = ["CHUNK", "Budget"]

CHUNK = 4 << 20  # bytes per paced transfer piece: the granularity the rate holds at


class Budget:
    """``rate`` bytes per second (None: unlimited); one sender thread spends it."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._free_at = 0.0  # when the bytes spent so far are paid for

    def spend(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may go, then count them spent."""
        if not self.rate:
            return
        now = time.monotonic()
        start = max(self._free_at, now)
        self._free_at = start + nbytes / float(self.rate)
        if start > now:
            time.sleep(start - now)
