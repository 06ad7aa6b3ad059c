"""Host topology of a job, explicit: which ranks share a host, and the redundancy's placement
rules over it (who holds a rank's partner copy, which hosts form a parity group and where its
parity lives).

A host is the set of ranks sharing one ``LOCAL_RANK`` space (one host memory, one tmpfs). A
rank's host id is ``$CKPTIO_HOST_ID`` if set, else ``hostname:boot_id`` (``host_id``); hosts
are numbered in the order of their lowest rank, and every host must run the same number of
ranks. **Partners(n)**: rank (host h, local l) is copied to (host (h+j) mod H, local l),
j = 1..n. **Parity(k)** (RAID-5-like, rotating): groups of k + 1 (up to 2k + 1) consecutive
hosts, each host holding one parity piece of 1/k of a shard, none covering its own host: any
one lost host per group is rebuilt. **Parity(k, m=2)** (RAID-6-like): groups of k + 2, stripe
j's P on position j and its Q on j + 1, each host holding 2/k: any two lost hosts per group.
**Failure domains** (``$CKPTIO_FAILURE_DOMAIN``: a rack, a switch, hosts that fail together):
the hosts are numbered with the domains interleaved, so a rank's partners and a parity group's
hosts fall in other domains; one that still puts two hosts of a group in one domain is refused.
Formulas, uneven host counts, refusals: docs/BEHAVIOUR.md, "ckptio.redundancy.topology".

Call order: ``host_id()`` and ``domain_id()`` on every rank -> the ids gathered from every
rank (a collective, the caller's: managing/guard.py) -> ``Topology.from_ids`` -> the placement
methods (``partners``, ``groups``, ``position``, ``contributed``, ``holder_of``), pure,
alike on every rank; ``check_domains`` once, where the protection starts.

Owns: the host ids, the numbering, the placement rules. Does not own: moving bytes
(redundancy/protect.py, redundancy/rebuild.py), the Partners/Parity declaration (redundancy/redundancy.py).
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ckptio.errors import CkptError
from ckptio.storage.holder import HOST_ID_ENV, host_id

__all__ = ["DOMAIN_ENV", "HOST_ID_ENV", "Topology", "domain_id", "host_id"]

DOMAIN_ENV = "CKPTIO_FAILURE_DOMAIN"
_ONE_HOST = (f"{{spec}}: every rank of this job runs on one host ({{hid}}): redundancy keeps "
             f"copies in other hosts' memory, so it needs at least 2 hosts. On one machine, "
             f"leave redundancy= out of the memory tier; if these ranks are on several hosts, "
             f"they report one id: set {HOST_ID_ENV} to each host's own name")


def domain_id() -> str:
    """This host's failure domain: ``$CKPTIO_FAILURE_DOMAIN`` (any string naming hosts that
    fail together: a rack, a switch, a power feed), or "" where none is given."""
    return os.environ.get(DOMAIN_ENV, "").strip()


@dataclass(frozen=True)
class Topology:
    """The hosts of a job: ``hosts[h]`` the ranks on host h (ascending), ``ids[h]`` its id,
    ``domains[h]`` its failure domain (empty: none given)."""

    hosts: tuple[tuple[int, ...], ...]
    ids: tuple[str, ...]
    domains: tuple[str, ...] = ()

    @classmethod
    def from_ids(cls, ids_by_rank: Sequence[str],
                 domains_by_rank: Sequence[str] | None = None) -> Topology:
        """From every rank's host id (index = rank), and its failure domain if any: hosts in
        the order of their lowest rank, or with the domains interleaved. CkptError if hosts run
        unequal counts, or give domains that disagree or only some hosts give one."""
        order: dict[str, list[int]] = {}
        for rank, hid in enumerate(ids_by_rank):
            order.setdefault(hid, []).append(rank)
        hosts, ids = [tuple(r) for r in order.values()], list(order)
        counts = {len(r) for r in hosts}
        if len(counts) > 1:
            listed = ", ".join(f"{hid}: {len(r)}" for hid, r in zip(ids, hosts))
            raise CkptError(f"redundancy across hosts needs the same number of ranks on every "
                            f"host (LOCAL_WORLD_SIZE); ranks per host: {listed}. Run as many "
                            f"ranks on each host, or set {HOST_ID_ENV} to group them evenly")
        domains = _host_domains(hosts, ids, domains_by_rank)
        if not domains:
            return cls(tuple(hosts), tuple(ids))
        spread = _interleaved(domains)
        return cls(tuple(hosts[h] for h in spread), tuple(ids[h] for h in spread),
                   tuple(domains[h] for h in spread))

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
        """``host 1 (id, ranks 2-3[, domain rack1])`` for messages."""
        ranks = self.hosts[host]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        domain = f", domain {self.domains[host]}" if self.domains else ""
        return f"host {host} ({self.ids[host]}, {span}{domain})"

    def others(self, rank: int) -> list[int]:
        """Every rank of the job but ``rank``, ascending."""
        return sorted(r for ranks in self.hosts for r in ranks if r != rank)

    def name_ranks(self, ranks: Sequence[int]) -> str:
        """``rank 2 on host 2 (id, rank 2), ...`` for messages ("" for none)."""
        return ", ".join(f"rank {r} on {self.describe(self.host_of(r))}" for r in ranks)

    def check_domains(self, groups: Sequence[Sequence[int]], what: str) -> None:
        """CkptError if two hosts of one group (host indices) share a failure domain."""
        for group in groups if self.domains else ():
            seen: dict[str, int] = {}
            for host in group:
                other = seen.setdefault(self.domains[host], host)
                if other != host:
                    count = len(set(self.domains))
                    raise CkptError(
                        f"{what}: {self.describe(other)} and {self.describe(host)} would hold "
                        f"parts of one group (a rank and its copies, or a parity group of "
                        f"{len(group)} hosts) in one failure domain, which can fail at once; "
                        f"{count} domain(s) for {self.size} hosts. Give each group as many "
                        f"domains as hosts (spread {DOMAIN_ENV} over more racks), or fewer "
                        "copies / a smaller parity group, or leave the domains out")

    # ------------------------------------------------------------ partner copies

    def partners(self, rank: int, n: int) -> list[int]:
        """The ranks holding ``rank``'s copies, first partner first: (h+j) mod H, same local."""
        if self.size == 1:
            raise CkptError(_ONE_HOST.format(spec=f"Partners({n})", hid=self.ids[0]))
        if not 1 <= n < self.size:
            raise CkptError(f"Partners({n}): {self.size} host(s); partner copies need more hosts "
                            f"than copies (at most Partners({self.size - 1})) so that no copy "
                            "is on its own host")
        h, local = self.host_of(rank), self.local_of(rank)
        return [self.rank_at(h + j, local) for j in range(1, n + 1)]

    def partner_groups(self, n: int) -> list[tuple[int, ...]]:
        """Each host with the n hosts holding its ranks' copies (for check_domains)."""
        return [tuple((h + j) % self.size for j in range(n + 1)) for h in range(self.size)]

    def partnered(self, rank: int, n: int) -> list[int]:
        """The ranks whose copies ``rank`` holds (j-th: the one it is j-th partner of)."""
        h, local = self.host_of(rank), self.local_of(rank)
        return [self.rank_at(h - j, local) for j in range(1, n + 1)]

    # ------------------------------------------------------------ parity

    def groups(self, k: int, m: int = 1) -> list[tuple[int, ...]]:
        """Parity groups of hosts (docs/BEHAVIOUR.md, "ckptio.redundancy.topology"): G = floor(H /
        (k+m)) runs of consecutive hosts as even as can be (the first H mod G of them one host
        longer); a group of n hosts codes with k' = n - m >= k."""
        size, spec = self.size, f"Parity(k={k})" if m == 1 else f"Parity(k={k}, m={m})"
        if size == 1:
            raise CkptError(_ONE_HOST.format(spec=spec, hid=self.ids[0]))
        if k < 1 or size < k + m:
            fix = f"Parity(k) with k <= {size - 1}, or Partners(1)" if m == 1 else (
                f"Parity(k, m={m}) with k <= {size - m}, or Partners({m})" if size > m else
                f"Partners({size - 1})")
            raise CkptError(f"{spec}: {size} host(s); a parity group is k + {m} hosts "
                            f"(each holds {m}/k of a shard of parity), so it needs at least "
                            f"{k + m} hosts: use {fix}")
        count = size // (k + m)
        each, extra = divmod(size, count)
        bounds = [g * each + min(g, extra) for g in range(count + 1)]
        return [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]

    def group_of(self, host: int, k: int, m: int = 1) -> int:
        return next(g for g, hosts in enumerate(self.groups(k, m)) if host in hosts)

    def position(self, host: int, k: int, m: int = 1) -> int:
        """``host``'s position in its parity group (0..n-1)."""
        return self.groups(k, m)[self.group_of(host, k, m)].index(host)

    @staticmethod
    def contributed(j: int, h: int, n: int) -> int:
        """Which piece the member at position h puts into stripe j (group of n): the stripe's
        data when it is < n - m (m = 1: h != j; m = 2: h not in (j, j + 1))."""
        return (j - h - 1) % n

    @staticmethod
    def stripe_data(j: int, n: int, m: int) -> list[tuple[int, int]]:
        """(position, piece index) of stripe j's data members, the highest position first."""
        return [(h, i) for h in reversed(range(n))
                if (i := Topology.contributed(j, h, n)) < n - m]

    @staticmethod
    def stripe_parity(j: int, n: int, m: int) -> list[int]:
        """The positions holding stripe j's P (j) and, with m = 2, its Q (j + 1)."""
        return [j, (j + 1) % n][:m]

    @staticmethod
    def holder_of(i: int, h: int, n: int) -> int:
        """The stripe (the position holding its P) of piece ``i`` of the member at position h."""
        return (h + 1 + i) % n


def _host_domains(hosts: Sequence[tuple[int, ...]], ids: Sequence[str],
                  by_rank: Sequence[str] | None) -> list[str]:
    """Each host's failure domain ([]: none given on any rank)."""
    if by_rank is None or not any(by_rank):
        return []
    domains = []
    for ranks, hid in zip(hosts, ids):
        found = {by_rank[r] for r in ranks}
        if len(found) > 1 or "" in found:
            raise CkptError(
                f"{DOMAIN_ENV}: host {hid} (ranks {ranks[0]}-{ranks[-1]}) gives "
                f"{sorted(found)!r}; set it to the same non-empty value on every rank of every "
                "host (its rack or switch), or on none")
        domains.append(found.pop())
    return domains


def _interleaved(domains: Sequence[str]) -> list[int]:
    """Host indices with the domains interleaved: each next host from the domain with the most
    hosts left (first seen on a tie), never the previous host's domain while another has one."""
    left: dict[str, deque[int]] = {}
    for host, domain in enumerate(domains):
        left.setdefault(domain, deque()).append(host)
    order: list[int] = []
    last = None
    while len(order) < len(domains):
        ready = [d for d, q in left.items() if q]
        pick = max([d for d in ready if d != last] or ready, key=lambda d: len(left[d]))
        order.append(left[pick].popleft())
        last = pick
    return order
