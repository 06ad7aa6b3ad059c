"""Protection of each memory step across hosts: partner copies or XOR parity, encoded and sent
off the training thread, committed with the step.

Call order (the Guard, on every rank: the redundancy is collective): ``Protector(...)`` once;
``submit(step)`` after each commit in this rank's memory, in step order; ``status()`` any time;
``wait()`` before a restore; ``close()`` last. Every rank protects the same steps in the same
order over the redundancy's own gloo group (peers.py); the steps of one protection, what a rank
does when it falls behind and what a kill leaves: ``Protector.run`` and ``Protector._protect``.

Owns: the protection's queue and status, the rule that only the newest protected step stays
protected. The thread, its lowered priority and the error raised once are the Worker's
(worker.py). Does not own: placement (topology.py), the stream and transport (peers.py), the names
on each host (marks.py), restore (rebuild.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.distributed.dist import silent_ranks
from ckptio.errors import CkptError, RankFailedError
from ckptio.io.worker import Worker
from ckptio.redundancy import erasure, marks, peers
from ckptio.redundancy.budget import Budget
from ckptio.redundancy.marks import Root, protected_steps
from ckptio.redundancy.redundancy import Parity, Partners
from ckptio.redundancy.topology import Topology
from ckptio.storage.store_contract import TreeStore

__all__ = ["PAUSE_ENV", "Protector", "newest_protected"]

log = logging.getLogger("ckptio")
PAUSE_ENV = "CKPTIO_TEST_PROTECT_PAUSE_S"
P_TAG, Q_TAG = 0, 2  # a rank's pieces for P and for Q go to a holder apart (another stripe)


@dataclass
class _State:
    queue: list[int] = field(default_factory=list)
    busy: int | None = None
    protected: int | None = None
    seconds: float | None = None  # the last: from submit to protected
    skipped: list[int] = field(default_factory=list)
    superseded: int = 0  # queued steps passed over for a newer one (Protector.run)
    error: str | None = None


@dataclass
class _Job:
    """One run of the worker: the newest queued step, then the step the ranks agreed on."""

    step: int
    done: bool = False  # protected


class Protector:
    """The protection of one rank (module docstring).

    Args:
        spec: Partners(n) or Parity(k).
        topology: the job's hosts and ranks (topology.py).
        group: the redundancy's gloo group (the protection thread's alone).
        rank: this rank.
        root: the memory tier's local directory (marks.py's layout under it).
        own_dir: step -> this rank's step directory in that tier.
        timeout_s: the group's timeout (Options.peer_timeout_s), named in messages.
    """

    def __init__(self, spec: Partners | Parity, topology: Topology, group: Any, rank: int,
                 root: str, own_dir: Any, timeout_s: float) -> None:
        self.spec, self.topology, self.group, self.rank = spec, topology, group, rank
        self.root, self._own_dir, self.timeout_s = root, own_dir, timeout_s
        self._tree = marks.tree_of(root)
        self._broken: RankFailedError | None = None  # a transfer failed: the group is unusable
        self._state = _State(protected=newest_protected(self._tree, rank))
        self._submitted: dict[int, float] = {}
        self._buffer: torch.Tensor | None = None  # read_stream's, reused from step to step
        # the host's budget shared by its ranks (each rank sends for its own shard)
        self._budget = Budget(spec.rate / len(topology.hosts[topology.host_of(rank)])
                              if spec.rate else None)
        self._worker: Worker[_Job] = Worker("ckptio-protect", self)
        self._lock = self._worker.lock
        if isinstance(spec, Partners):
            topology.partners(rank, spec.n)  # refused here if the hosts are too few
            topology.check_domains(topology.partner_groups(spec.n), f"ckptio.Partners({spec.n})")
        else:
            m = "" if spec.m == 1 else f", m={spec.m}"
            topology.check_domains(topology.groups(spec.k, spec.m), f"ckptio.Parity(k={spec.k}{m})")

    def submit(self, step: int) -> None:
        """``step`` committed in this rank's memory: protect it (in order). CkptError after
        close()."""
        with self._lock:
            self._worker.wake()  # first: refused after close(); runs once the lock is let go
            self._state.queue.append(step)
            self._submitted[step] = time.monotonic()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every submitted step is protected or skipped (True) or ``timeout`` (False);
        raises the first error not raised yet, once."""
        return self._worker.wait(timeout)

    def close(self) -> None:
        """wait(), then stop the thread (the error wait() raises is raised after)."""
        self._worker.close()

    def status(self) -> dict[str, Any]:
        with self._lock:
            s = self._state
            return {"redundancy": self.spec.describe(), "protected": s.protected,
                    "protecting": s.busy, "queued": list(s.queue), "protect_seconds": s.seconds,
                    "unprotected": list(s.skipped), "superseded": s.superseded,
                    "protect_error": s.error}

    # ------------------------------------------ the worker's Jobs (worker.py): its thread

    def take(self) -> _Job | None:
        """The newest queued step (under the lock)."""
        if not self._state.queue:
            return None
        self._state.busy = self._state.queue[-1]
        return _Job(self._state.busy)

    def pending(self) -> bool:
        """Whether a step is queued or being protected (under the lock)."""
        return bool(self._state.queue) or self._state.busy is not None

    def run(self, job: _Job) -> None:
        """Agree on the step to protect, then protect it (``job.done``: protected).

        **Behind: the newest step.** When the thread falls behind the saves (several steps
        queued), the ranks agree (a MIN all_reduce of each rank's newest queued step) on the
        newest step every rank has queued and protect that one; the older queued steps are
        superseded (never protected, counted in status()'s ``superseded``), as the previous
        protected step stays protected until the newer one is. A transfer that fails (a peer
        killed, or silent for ``Options.peer_timeout_s``) raises RankFailedError naming the
        peer, kept by the worker, and the protection stops: the group is unusable, so later
        steps fail at once (close() never waits for another timeout)."""
        job.step = self._agree(job.step)
        job.done = self._protect(job.step)

    def finish(self, job: _Job, error: Exception | None) -> None:
        """Record ``job``'s outcome (under the lock): protected, or skipped with the steps
        queued up to it."""
        step, s = job.step, self._state
        if error is not None:
            log.warning("ckptio: protecting step %d failed: %s: %s", step, type(error).__name__,
                        error)
        s.busy = None
        failed = [q for q in s.queue if q <= step] or [step]  # agreeing failed: still queued
        s.queue = [q for q in s.queue if q > step]
        if job.done:
            s.protected = step
            s.seconds = time.monotonic() - self._submitted.pop(step, 0.0)
            s.error = None
        else:
            s.skipped = [*s.skipped, *failed][-10:]
            for q in failed:
                self._submitted.pop(q, None)
        if error is not None:
            s.error = f"step {step}: {type(error).__name__}: {error}"

    def _agree(self, newest: int) -> int:
        """The step every rank protects next: the oldest of the ranks' newest queued steps
        (collective); the older queued steps are superseded (module docstring)."""
        self._check_broken(newest)
        with self._talking(newest, "agreeing on the step to protect with", None):
            step = peers.agree_min(self.group, newest)
        with self._lock:
            older = [s for s in self._state.queue if s < step]
            self._state.queue = [s for s in self._state.queue if s > step]
            self._state.superseded += len(older)
            self._state.busy = step
            for s in older:
                self._submitted.pop(s, None)
        return step

    def _check_broken(self, step: int) -> None:
        if self._broken is not None:
            raise RankFailedError(f"step {step} is not protected: the protection stopped at an "
                                  f"earlier step: {self._broken}", self._broken.ranks)

    def _protect(self, step: int) -> bool:
        """Protect ``step`` (collective; on the worker's thread) -> whether it is protected:

        1. each rank reads its own step's stream (peers.read_stream) and all ranks exchange its
           metadata (manifest, files, length; a rank that could not read sends length -1 and
           the step is skipped on every rank, said in the log and in status);
        2. **Partners(n)**: each rank sends its stream to its n partners and receives the
           streams of the n ranks it is partner of, writing each as ``copy-r<src>/`` (a
           checkpoint, its manifest last). **Parity(k)** (rotating, topology.py): in its group of
           k + 1 hosts, each rank sends piece (j - h - 1) mod (k + 1) of its stream to the
           member at position j and XORs the k pieces it receives into its own parity piece
           (ceil(longest / k) bytes), written with a JSON naming every member's manifest,
           files, length and the piece's xxh3;
        3. each rank writes ``held-r<rank>.json`` (what it holds for the step), last;
        4. all ranks agree (a MIN all_reduce) that every rank wrote; then each writes
           ``protected-r<rank>.json``: the step is protected, and the protection of older
           steps is removed (only the newest protected step stays protected, with the
           protection of its bases where it is a delta: any rank's).

        A kill anywhere before 4 leaves the step without ``protected`` markers: restore treats
        its copies as absent and falls back to the previous protected step, whose copies are
        only removed after this one is protected. ``CKPTIO_TEST_PROTECT_PAUSE_S`` (test
        support) sleeps after the streams are read and the step's location made, so a test can
        kill ranks during encoding. Its reads reuse one buffer from step to step."""
        self._check_broken(step)
        try:
            read = peers.read_stream(marks.tree_of(self._own_dir(step)), self._buffer)
            if self._buffer is None or read.data.numel() > self._buffer.numel():
                self._buffer = read.data  # sent and waited for before the next step's read
            meta: dict[str, Any] = {"step": step, **read.meta()}
            stream: peers.Stream | None = read
        except CkptError as exc:
            log.warning("ckptio: step %d cannot be protected on rank %d: %s", step, self.rank, exc)
            stream, meta = None, {"step": step, "nbytes": -1}
        with self._talking(step, "exchanging the step's metadata with", None):
            metas = peers.all_gather_json(self.group, meta)
        if any(m["nbytes"] < 0 or m["step"] != step for m in metas):
            bad = [r for r, m in enumerate(metas) if m["nbytes"] < 0 or m["step"] != step]
            log.warning("ckptio: step %d is not protected: ranks %s could not read it", step, bad)
            return False
        assert stream is not None  # internal: nbytes >= 0 on this rank
        directory = marks.held(self._tree, step)
        directory.prepare()
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause:
            time.sleep(pause)
        ok = True
        try:
            if isinstance(self.spec, Partners):
                held = self._partners(stream, metas, directory)
            else:
                held = self._parity(stream, metas, directory)
            peers.write_json(directory, f"held-{marks.rank_name(self.rank)}.json",
                             {"step": step, "how": self.spec.describe(), "items": held})
        except RankFailedError:
            raise  # a peer gone: the group is unusable, no agreement can follow
        except CkptError as exc:
            log.warning("ckptio: rank %d could not keep its copies of step %d: %s", self.rank,
                        step, exc)
            ok = False
        with self._talking(step, "agreeing that every copy is written with", None):
            agreed = peers.all_ok(self.group, ok)
        if not agreed:
            return False
        peers.write_json(directory, f"protected-{marks.rank_name(self.rank)}.json",
                         {"step": step, "how": self.spec.describe()})
        self._drop_before(step, {b for m in metas for b in m.get("bases", [])})
        return True

    def _partners(self, stream: peers.Stream, metas: list[dict[str, Any]],
                  directory: TreeStore) -> list[dict[str, Any]]:
        """Send to the partners, receive from the partnered (every transfer done before any
        write, so a failed write never leaves a peer waiting), then write the copies."""
        n = self.spec.n  # type: ignore[union-attr]
        step = metas[self.rank]["step"]
        sends = [(stream.data, dst, 0) for dst in self.topology.partners(self.rank, n)]
        got: list[tuple[int, torch.Tensor]] = []
        self._exchange(step, sends, [(src, metas[src]["nbytes"], 0) for src in
                                     self.topology.partnered(self.rank, n)],
                       "a partner copy", lambda src, _tag, data: got.append((src, data)))
        held = []
        for src, data in got:
            meta = metas[src]
            peers.write_checkpoint(directory.child(marks.copy_name(src)),
                                   meta["manifest"].encode(), [tuple(f) for f in meta["files"]],
                                   data)
            held.append({"kind": "copy", "rank": src, "manifest_digest": meta["digest"],
                         "digest": peers.digest(data), "bases": meta.get("bases", [])})
        return held

    def _parity(self, stream: peers.Stream, metas: list[dict[str, Any]],
                directory: TreeStore) -> list[dict[str, Any]]:
        """Rotating parity in this rank's group of n (topology.py): piece (j - me - 1) mod n of
        this rank's shard goes to stripe j's P holder (position j) and, with m = 2, to its Q
        holder (j + 1); the pieces received are coded into this rank's block (P of stripe me,
        then Q of stripe me - 1), written with its xxh3 and every member's manifest."""
        spec, topo = self.spec, self.topology
        assert isinstance(spec, Parity)  # internal: called for Parity only
        k, m = spec.k, spec.m
        host, local = topo.host_of(self.rank), topo.local_of(self.rank)
        group = topo.group_of(host, k, m)
        members = [topo.rank_at(h, local) for h in topo.groups(k, m)[group]]
        n, me, step = len(members), topo.position(host, k, m), metas[self.rank]["step"]
        p = peers.piece_nbytes(max(metas[r]["nbytes"] for r in members), n - m)
        sends = [(peers.piece(stream.data, topo.contributed(j, me, n), p), members[h], tag)
                 for j in range(n) if topo.contributed(j, me, n) < n - m
                 for h, tag in zip(topo.stripe_parity(j, n, m), (P_TAG, Q_TAG))]
        receives = [(members[h], peers.piece_len(metas[members[h]]["nbytes"], i, p), tag)
                    for j, tag in [(me, P_TAG), *([((me - 1) % n, Q_TAG)] if m == 2 else [])]
                    for h, i in topo.stripe_data(j, n, m)]  # highest position first: Horner
        block = torch.zeros(m * p, dtype=torch.uint8)
        q = erasure.Horner(block[p:])
        self._exchange(step, sends, receives, "a parity piece",
                       lambda src, tag, got: peers.xor_into(block[:p], got) if tag == P_TAG
                       else q.add(members.index(src), got))
        q.finish()
        name = marks.parity_name(group, local)
        directory.write_file(f"{name}.bin",
                             block.numpy().data.cast("B") if block.numel() else b"")
        info = {"kind": "parity", "group": group, "local": local, "position": me, "m": m,
                "piece": p, "nbytes": m * p, "digest": peers.digest(block),
                "bases": {str(r): metas[r].get("bases", []) for r in members},
                "members": [{"rank": r, "host": topo.host_of(r), "nbytes": metas[r]["nbytes"],
                             "manifest": metas[r]["manifest"], "files": metas[r]["files"],
                             "manifest_digest": metas[r]["digest"]} for r in members]}
        peers.write_json(directory, f"{name}.json", info)
        return [{key: v for key, v in info.items() if key != "members"}]

    def _exchange(self, step: int, sends: list[tuple[torch.Tensor, int, int]],
                  receives: list[tuple[int, int, int]], what: str,
                  take: Callable[[int, int, torch.Tensor], None]) -> None:
        """Send each (data, dst, tag), receive each (src, nbytes, tag) and ``take(src, tag,
        data)`` each, in the order given. Unlimited: every send posted whole, then each receive
        in turn, taken as it lands (one in memory at a time). Under the budget: every receive
        posted first, then the sends paced in chunks (peers.send_paced): bytes leave no faster
        than the budget allows."""
        if not self._budget.rate:
            with self._talking(step, f"sending {what} to", None):
                works = [(dst, peers.send(self.group, data, dst, tag))
                         for data, dst, tag in sends]
            for src, nbytes, tag in receives:
                with self._talking(step, f"receiving {what} from", src):
                    data = peers.recv(self.group, nbytes, src, tag)
                take(src, tag, data)
            self._wait(step, works)
            return
        with self._talking(step, f"exchanging {what} with", None):
            posted = [(src, tag, *peers.post_recv(self.group, nbytes, src, tag))
                      for src, nbytes, tag in receives]
            works = peers.send_paced(self.group, sends, self._budget)
        for src, tag, data, pieces in posted:
            self._wait(step, [(src, work) for work in pieces], f"receiving {what} from")
            take(src, tag, data)
        self._wait(step, works)

    def _wait(self, step: int, works: list[tuple[int, Any]], what: str = "sending to") -> None:
        for dst, work in works:
            if work is not None:
                with self._talking(step, what, dst):
                    work.wait()

    @contextmanager
    def _talking(self, step: int, what: str, peer: int | None) -> Iterator[None]:
        """A transfer with ``peer`` (None: a collective of every rank): its failure (a peer
        gone: connection closed, or no answer within peer_timeout_s; or the group destroyed by
        this process) -> RankFailedError naming it; the group is then unusable, so the
        protection stops (later steps fail at once)."""
        try:
            yield
        except (RuntimeError, ValueError) as exc:  # torch.distributed's errors: a peer gone
            # (DistBackendError included) or, ValueError, the group destroyed in this process
            gone = isinstance(exc, RuntimeError)
            silent = (silent_ranks(self.topology.others(self.rank), self.group)
                      if gone and peer is None else [])  # a collective's: who stopped beating
            who = (self.topology.name_ranks(silent) or "one of the job's ranks" if peer is None
                   else self.topology.name_ranks([peer]))
            why = (f"it died or gave no answer within peer_timeout_s={self.timeout_s:g} s" if gone
                   else "this process destroyed the process group (destroy_process_group) "
                   "while the protection was in flight")
            error = RankFailedError(
                f"rank {self.rank}: protecting step {step} across hosts failed {what} {who}: "
                f"{why} ({type(exc).__name__}: {exc}). Step {step} is not protected (the "
                "previous protected step is kept); the protection stops: restart the job (a "
                "restore brings lost hosts' ranks back)",
                (peer,) if gone and peer is not None else tuple(silent))
            self._broken = error
            raise error from exc

    def _drop_before(self, step: int, keep: set[int]) -> None:
        """Remove this host's protection of steps older than ``step`` but the bases in ``keep``
        (a delta step's rebuild needs its base's: rebuild.py) (local rank 0 does)."""
        if self.topology.local_of(self.rank) != 0:
            return
        for older, where in marks.held_steps(self._tree).items():
            if older < step and older not in keep:
                problems = where.remove_tree()
                if problems:
                    log.debug("ckptio: the protection of step %d stays in part: %s", older,
                              problems[0])


def newest_protected(root: Root, rank: int) -> int | None:
    """The newest step whose protection ``rank`` committed under ``root``, or None."""
    steps = protected_steps(root, rank)
    return steps[-1] if steps else None

