"""Host topology of a job, explicit: which ranks share a host, and the redundancy's placement
rules over it (who holds a rank's partner copy, which hosts form a parity group and where its
parity lives).

**The rule.** A host is the set of ranks sharing one ``LOCAL_RANK`` space (one host memory, one
tmpfs). Each rank's host id is, first found:

1. ``$CKPTIO_HOST_ID`` (any string; tests give several groups of ranks on one machine their own
   ids, and their own ``$CKPTIO_SHM_DIR``, to play several hosts);
2. else ``hostname:boot_id`` (two containers of one machine share a boot id but not a hostname).

Host ids are gathered from every rank; hosts are numbered 0..H-1 in the order of their lowest
rank, and a rank's local rank is its index among its host's ranks in rank order (it equals
``$LOCAL_RANK`` under torchrun, which numbers ranks host by host). Every host must run the same
number of ranks (``$LOCAL_WORLD_SIZE``): the placements below pair local rank l with local rank
l, so an uneven job is refused with the count per host.

**Partners(n)**: rank (host h, local l) has its copies held by (host (h+j) mod H, local l) for
j = 1..n; never its own host (n < H is required).

**Parity(k)**: hosts are cut into groups of k consecutive hosts, group g = hosts [g*k, g*k+k)
(the last group may be shorter); group g's parity (local rank l's parity block = XOR of the
group's local-l ranks' bytes, each padded to the longest) is held by (host ((g+1)*k) mod H,
local l): the first host of the next group, so no host holds parity of its own group's data
(H > k is required). Any one lost host of a group is rebuilt from the group's other hosts and
the parity; memory per host is about (1 + 1/k) x its state (the parity holders of a group pay
one block of the group's longest shard).

Owns: the host ids, the numbering, the placement rules. Does not own: moving bytes
(tiering/protect.py, tiering/rebuild.py), the Partners/Parity declaration (tiering/redundancy.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from ckptio.errors import CkptError
from ckptio.storage import holder

__all__ = ["HOST_ID_ENV", "Topology", "host_id"]

HOST_ID_ENV = "CKPTIO_HOST_ID"


def host_id() -> str:
    """This process's host id (module docstring's rule)."""
    explicit = os.environ.get(HOST_ID_ENV, "").strip()
    return explicit or f"{socket.gethostname()}:{holder.boot_id()}"


@dataclass(frozen=True)
class Topology:
    """The hosts of a job: ``hosts[h]`` the ranks on host h (ascending), ``ids[h]`` its id."""

    hosts: tuple[tuple[int, ...], ...]
    ids: tuple[str, ...]

    @classmethod
    def from_ids(cls, ids_by_rank: Sequence[str]) -> Topology:
        """From every rank's host id (index = rank). CkptError if hosts run unequal counts."""
        order: dict[str, list[int]] = {}
        for rank, hid in enumerate(ids_by_rank):
            order.setdefault(hid, []).append(rank)
        topo = cls(tuple(tuple(r) for r in order.values()), tuple(order))
        counts = {len(r) for r in topo.hosts}
        if len(counts) > 1:
            listed = ", ".join(f"{hid}: {len(r)}" for hid, r in zip(topo.ids, topo.hosts))
            raise CkptError(f"redundancy across hosts needs the same number of ranks on every "
                            f"host (LOCAL_WORLD_SIZE); ranks per host: {listed}. Run as many "
                            f"ranks on each host, or set {HOST_ID_ENV} to group them evenly")
        return topo

    @property
    def size(self) -> int:
        """H, the number of hosts."""
        return len(self.hosts)

    @property
    def local_size(self) -> int:
        return len(self.hosts[0])

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    def local_of(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    def rank_at(self, host: int, local: int) -> int:
        return self.hosts[host % self.size][local]

    def describe(self, host: int) -> str:
        """``host 1 (id, ranks 2-3)`` for messages."""
        ranks = self.hosts[host]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"host {host} ({self.ids[host]}, {span})"

    # ------------------------------------------------------------ partner copies

    def partners(self, rank: int, n: int) -> list[int]:
        """The ranks holding ``rank``'s copies, first partner first: (h+j) mod H, same local."""
        if not 1 <= n < self.size:
            raise CkptError(f"Partners({n}): {self.size} host(s); partner copies need more hosts "
                            f"than copies (at most Partners({self.size - 1})) so that no copy "
                            "is on its own host")
        h, local = self.host_of(rank), self.local_of(rank)
        return [self.rank_at(h + j, local) for j in range(1, n + 1)]

    def partnered(self, rank: int, n: int) -> list[int]:
        """The ranks whose copies ``rank`` holds (j-th: the one it is j-th partner of)."""
        h, local = self.host_of(rank), self.local_of(rank)
        return [self.rank_at(h - j, local) for j in range(1, n + 1)]

    # ------------------------------------------------------------ parity

    def groups(self, k: int) -> list[tuple[int, ...]]:
        """Parity groups of hosts: [g*k, g*k+k) ∩ [0, H)."""
        if k < 1 or self.size <= k:
            raise CkptError(f"Parity(k={k}): {self.size} host(s); parity over groups of k hosts "
                            f"needs more than k hosts (its parity lives on a host outside the "
                            f"group): use k <= {self.size - 1}, or Partners(1)")
        return [tuple(range(g, min(g + k, self.size))) for g in range(0, self.size, k)]

    def group_of(self, host: int, k: int) -> int:
        return host // k

    def parity_host(self, group: int, k: int) -> int:
        """The host holding group ``group``'s parity: the next group's first host, mod H."""
        return ((group + 1) * k) % self.size

    def parity_groups_held(self, host: int, k: int) -> list[int]:
        """The groups whose parity ``host`` holds."""
        return [g for g in range(len(self.groups(k))) if self.parity_host(g, k) == host]
