"""Redundancy of a memory tier across hosts, as the user declares it: Partners and Parity.

    ckptio.Tier("shm://run", redundancy=ckptio.Partners(1))   # a full copy on the next host
    ckptio.Tier("shm://run", redundancy=ckptio.Parity(k=3))   # XOR parity, groups of 3+1 hosts
    ckptio.Tier("shm://run", redundancy=ckptio.Parity(k=3, m=2))  # P+Q, groups of 3+2 hosts
    ckptio.Tier("shm://run")                                  # none (a lost host: disk)

With redundancy, the memory tier is rank-local (NVIDIA resiliency-ext's "local checkpoints"):
each rank keeps its own state as a one-rank checkpoint in its host's memory, under
``shm://NAME/r<rank>/step-N``, and the slower tiers hold the same per rank
(``<location>/r<rank>/step-N``), copied by each rank's own drain. After each commit in memory a
background thread (redundancy/protect.py) sends the step's bytes over a gloo process group of its
own to the partner(s), or as parity pieces to the other hosts of its parity group, which keep
them in their memory under ``shm://NAME/.redundancy/step-N``; the step is protected once every
rank's copies are written and a marker is committed last. A restore agrees on the newest step
every rank can obtain verified: its own memory, a partner's copy, rebuilt from parity, else disk
(redundancy/rebuild.py). Placement rules: redundancy/topology.py.

Partners(n) costs (1 + n) x the state in host memory and survives any n lost hosts; Parity(k)
costs (1 + 1/k) x (every host holds 1/k of a shard of parity) and survives one lost host per
group of k + 1 hosts (a second loss in a group: the disk tier); Parity(k, m=2) costs (1 + 2/k) x
and survives two lost hosts per group of k + 2.

Owns: the declaration and its validation. Does not own: placement (topology.py), encoding and
transfer (protect.py), restore (rebuild.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptio.errors import CkptError

__all__ = ["Parity", "Partners", "Redundancy", "check_redundancy"]


@dataclass(frozen=True)
class Partners:
    """Full copies of each rank's newest memory step in ``n`` other hosts' memory. ``rate``:
    the bytes per second each host's ranks together send for it (None: as fast as the link
    goes; a budget leaves the link to the training's own traffic, redundancy/budget.py)."""

    n: int = 1
    rate: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise CkptError(f"ckptio.Partners({self.n!r}): the number of copies, an integer >= 1")
        _check_rate(self, self.rate)

    def describe(self) -> str:
        return f"partners(n={self.n}{_rate_text(self.rate)})"

    @property
    def least_hosts(self) -> int:
        """The fewest hosts it can place its copies on: the rank's own and ``n`` others."""
        return self.n + 1


@dataclass(frozen=True)
class Parity:
    """Rotating parity over groups of ``k + m`` hosts, each holding m/k of a shard of parity
    (redundancy/topology.py): ``m=1`` XOR, any one lost host per group; ``m=2`` XOR and
    Reed-Solomon (redundancy/erasure.py), any two."""

    k: int = 3
    rate: float | None = None  # as Partners.rate
    m: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise CkptError(f"ckptio.Parity(k={self.k!r}): hosts per parity group, an integer "
                            ">= 1 (3: 1.33x memory)")
        if self.m not in (1, 2) or isinstance(self.m, bool):
            raise CkptError(f"ckptio.Parity(k={self.k}, m={self.m!r}): parity pieces per group, "
                            "1 (survives one lost host per group) or 2 (survives two)")
        _check_rate(self, self.rate)

    def describe(self) -> str:
        m = "" if self.m == 1 else f", m={self.m}"
        return f"parity(k={self.k}{m}{_rate_text(self.rate)})"

    @property
    def least_hosts(self) -> int:
        """The fewest hosts a parity group is made of: k + m."""
        return self.k + self.m

    def block_nbytes(self, longest: int, members: int) -> int:
        """The parity bytes each member of a group of ``members`` hosts holds when the
        longest shard is ``longest`` bytes: m pieces of ceil(longest / (members - m))."""
        return self.m * -(-longest // (members - self.m))


def _check_rate(spec: object, rate: object) -> None:
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                             or not rate > 0):
        raise CkptError(f"ckptio.{type(spec).__name__}(rate={rate!r}): bytes per second each "
                        "host sends for the protection, > 0 (e.g. 200e6), or None: unlimited")


def _rate_text(rate: float | None) -> str:
    return "" if rate is None else f", rate={rate:g}"


Redundancy = Partners | Parity


def check_redundancy(location: str, value: object, memory: bool) -> None:
    """CkptError unless ``value`` is None, Partners or Parity on a memory tier."""
    if value is None:
        return
    if not isinstance(value, (Partners, Parity)):
        raise CkptError(f"Tier({location!r}, redundancy={value!r}): give ckptio.Partners(1), "
                        "ckptio.Parity(k=3) or None")
    if not memory:
        raise CkptError(f"Tier({location!r}, redundancy=...): redundancy protects a memory tier "
                        "(shm://NAME); a disk or object-store tier is durable by itself")
