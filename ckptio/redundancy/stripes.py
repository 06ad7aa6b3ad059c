"""A lost rank's shard rebuilt from its parity group by the survivors, each lost rank receiving
only its own bytes: a chain per lost piece through the members that hold a part of its stripe.

Every lost piece is a sum, in GF(2^8), of the stripe's surviving parts times constants
(erasure.py's code: P alone, Q alone, or P and Q where two pieces of a stripe are lost): so
the survivors holding those parts form a chain, each one adding its part times its constant to
what the previous one sent and passing it on, the last one sending the piece to the lost rank,
which receives it straight into its step's bytes. A lost rank receives its step's length (the
pieces' zero padding is never sent), each piece from the stripe's last survivor: several
survivors at once. Every transfer is cut into chunks of ``budget.CHUNK``, so a chain is a
pipeline; every rank posts its receives first, sends the chunks of the chains it starts (they
need nothing received), then handles its other chunks in one order, the same on every rank (no
cycle: a chunk waits only on earlier ones).

Call order (rebuild.py, on every rank, after the items' metadata are gathered): ``plan`` (pure,
the same everywhere) -> ``run``. Owns: the chains and their transfers. Does not own: the field
arithmetic (erasure.py), placement (topology.py), what a restore decides (rebuild.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptio.errors import CkptError
from ckptio.redundancy import erasure, peers
from ckptio.redundancy.budget import CHUNK
from ckptio.redundancy.topology import Topology

__all__ = ["Chain", "Term", "plan", "run"]

TAG_BASE = 16  # chain c's messages carry tag TAG_BASE + c (below: rebuild.py's own tags)


@dataclass(frozen=True)
class Term:
    """A survivor's part of a stripe, times ``coefficient`` (GF(2^8)): the bytes from
    ``offset`` on of its own step ("data": its piece there) or of its parity block ("block":
    P at 0, Q at the piece size)."""

    rank: int
    kind: str  # "data" | "block"
    offset: int
    coefficient: int


@dataclass(frozen=True)
class Chain:
    """Piece ``piece`` of ``receiver``'s shard: ``length`` bytes at ``offset`` of its step's
    bytes, summed along ``terms`` in order, the last one sending it to the receiver."""

    receiver: int
    piece: int
    offset: int
    length: int
    terms: tuple[Term, ...]


def plan(members: list[int], missing: list[int], receiver: int, m: int, p: int,
         nbytes: int) -> list[Chain]:
    """The chains that rebuild ``receiver``'s shard of ``nbytes`` (pieces of ``p`` bytes) in
    its parity group ``members`` (group rank order), the ``missing`` members contributing
    nothing. CkptError where a stripe has more lost pieces than its parity can solve."""
    n, me = len(members), members.index(receiver)
    lost = {members.index(r) for r in missing}
    chains = []
    for i in range(n - m):
        length = peers.piece_len(nbytes, i, p)
        if length:
            j = Topology.holder_of(i, me, n)
            terms = _terms(j, n, m, me, lost)
            ordered = sorted(terms, key=lambda t: (t[0] - j - 1) % n)  # P's holder last
            chains.append(Chain(receiver, i, i * p, length, tuple(
                Term(members[h], "block" if kind in "PQ" else kind,
                     index * p if kind == "data" else p * (kind == "Q"), c)
                for h, kind, index, c in ordered)))
    return chains


def _terms(j: int, n: int, m: int, me: int, lost: set[int]) -> list[tuple[int, str, int, int]]:
    """(position, kind, piece index, coefficient) of stripe j's parts that sum to the piece of
    the member at position ``me`` (erasure.solve's algebra, spread over the holders)."""
    data = Topology.stripe_data(j, n, m)
    gone = [h for h, _i in data if h in lost]
    at_p, at_q = (Topology.stripe_parity(j, n, m) + [-1])[:2]
    p_ok, q_ok = at_p not in lost, m == 2 and at_q not in lost
    present = [(h, i) for h, i in data if h not in lost]
    if len(gone) == 1 and p_ok:
        return [(at_p, "P", 0, 1), *[(h, "data", i, 1) for h, i in present]]
    if len(gone) == 1 and q_ok:
        c0 = erasure.inverse(erasure.power(me))
        return [(at_q, "Q", 0, c0),
                *[(h, "data", i, erasure.mul(c0, erasure.power(h))) for h, i in present]]
    if len(gone) == 2 and p_ok and q_ok:
        other = next(h for h in gone if h != me)
        c0 = erasure.inverse(erasure.power(me) ^ erasure.power(other))
        return [(at_q, "Q", 0, c0), (at_p, "P", 0, erasure.mul(c0, erasure.power(other))),
                *[(h, "data", i, erasure.mul(c0, erasure.power(h) ^ erasure.power(other)))
                  for h, i in present]]
    raise CkptError(f"stripe {j} of a parity group of {n} with lost positions {sorted(lost)} "
                    f"cannot be rebuilt (m = {m})")


Part = Callable[[str], torch.Tensor]  # "data" / "block" -> this rank's bytes of it


@dataclass
class Outcome:
    """What ``run`` did on this rank."""

    received: int = 0  # bytes received
    error: str | None = None  # the first failure of this rank's own sums (then passed on as is)


def run(group: Any, rank: int, chains: list[Chain], part: Part, out: torch.Tensor | None,
        base_tag: int = TAG_BASE, landed: Callable[[int, int], None] | None = None) -> Outcome:
    """Run this rank's share of ``chains`` (all of the round's, alike on every rank): its terms'
    sums passed on, and, where it is a receiver, its pieces received into ``out`` (its step's
    bytes). A failure of this rank's own sum is recorded (``Outcome.error``) and the chunk
    passed on as it is, so no rank waits for it; the receiver's check finds the piece wrong.
    A link from this rank to itself (two terms, or the last term and the receiver, on one
    rank) hands the chunk over in memory. The chunks of the chains this rank starts are all
    sent before it waits for any (they need nothing received). ``landed(lo, hi)``: told of
    each range of ``out`` received, as it lands (in the order the senders send)."""
    outcome = Outcome()
    posted = _post(group, rank, chains, out, base_tag, outcome)
    sends: list[Any] = []
    mine = [(q, c, t) for q in range(max((len(_chunks(ch.length)) for ch in chains), default=0))
            for c, chain in enumerate(chains) for t, term in enumerate(chain.terms)
            if term.rank == rank and q < len(_chunks(chain.length))]
    # a chain's first term needs nothing received: all of those chunks go first (stable: in
    # the order above), so no chain waits for this rank's loop to reach its start
    for q, c, t in sorted(mine, key=lambda e: e[2] != 0):
        chain = chains[c]
        term, (lo, hi) = chain.terms[t], _chunks(chain.length)[q]
        data = part(term.kind)[term.offset:]
        chunk = _sum(posted.pop((c, q, t), None), data, term.coefficient, lo, hi, outcome)
        last = t + 1 == len(chain.terms)
        dst = chain.receiver if last else chain.terms[t + 1].rank
        if dst != rank:
            sends.append(dist.isend(chunk, dst, group=group, tag=base_tag + c))
        elif last:
            assert out is not None  # internal: a receiver has its step's bytes
            out[chain.offset + lo:chain.offset + hi].copy_(chunk)
            if landed is not None:
                landed(chain.offset + lo, chain.offset + hi)
        else:  # a copy: the chunk may be this rank's own bytes, left as they are
            posted[(c, q, t + 1)] = (chunk.clone(), None)
    for c, q, t in sorted(posted, key=lambda k: (k[1], k[0])):  # as the senders send them
        if t == -1:  # a piece this rank receives as a receiver
            posted[(c, q, t)][1].wait()
            if landed is not None:
                lo, hi = _chunks(chains[c].length)[q]
                landed(chains[c].offset + lo, chains[c].offset + hi)
    for work in sends:
        work.wait()
    return outcome


# (chain, chunk, term that adds to it; -1: the receiver) -> (buffer, work; None: at hand)
Posted = dict[tuple[int, int, int], tuple[torch.Tensor, Any]]


def _post(group: Any, rank: int, chains: list[Chain], out: torch.Tensor | None, base_tag: int,
          outcome: Outcome) -> Posted:
    """Every receive of this rank posted, before any send: the sums it adds to (a buffer of
    its own each) and its own pieces (into ``out``); none from itself."""
    posted: Posted = {}
    for c, chain in enumerate(chains):
        for t in range(1, len(chain.terms) + 1):
            last = t == len(chain.terms)
            src = chain.terms[t - 1].rank
            if (chain.receiver if last else chain.terms[t].rank) != rank or src == rank:
                continue
            if last:
                assert out is not None  # internal: a receiver has its step's bytes
                buf = out[chain.offset:chain.offset + chain.length]
            else:
                buf = torch.empty(chain.length, dtype=torch.uint8)
            for q, (lo, hi) in enumerate(_chunks(chain.length)):
                posted[(c, q, -1 if last else t)] = (buf, dist.irecv(
                    buf[lo:hi], src, group=group, tag=base_tag + c))
                outcome.received += hi - lo
    return posted


def _sum(got: tuple[torch.Tensor, Any] | None, data: torch.Tensor, c: int, lo: int, hi: int,
         outcome: Outcome) -> torch.Tensor:
    """Chunk [lo, hi) of what arrived (None: this rank starts the chain; a work of None: the
    chunk itself, handed over by this rank) plus ``c`` times this rank's part (shorter where
    its shard ends: zeros beyond)."""
    mine = data[min(lo, data.numel()):min(hi, data.numel())]
    if got is None:
        if c == 1 and mine.numel() == hi - lo:
            return mine  # sent as it is: no copy
        if c == 1:  # where its shard ends: copied and the rest zeroed, not XORed into zeros
            acc = torch.empty(hi - lo, dtype=torch.uint8)
            acc[:mine.numel()].copy_(mine)
            acc[mine.numel():].zero_()
            return acc
        acc = torch.zeros(hi - lo, dtype=torch.uint8)
    elif got[1] is None:
        acc = got[0]
    else:
        buf, work = got
        work.wait()
        acc = buf[lo:hi]
    if outcome.error is None:
        try:
            erasure.mul_into(acc, mine, c)
        except Exception as exc:  # noqa: BLE001 - the chain goes on (module docstring); the
            # error is this rank's outcome, said to every rank by the caller
            outcome.error = f"{type(exc).__name__}: {exc}"
    return acc


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK, nbytes)) for lo in range(0, nbytes, CHUNK)]
