"""Protection of each memory step across hosts: partner copies or XOR parity, encoded and sent
off the training thread, committed with the step.

One thread per rank (every rank runs one: the redundancy is collective), fed by the memory
tier's commits in step order; every rank protects the same steps in the same order over the
redundancy's own gloo group (peers.py). For step N:

1. each rank reads its own step's stream (peers.read_stream) and all ranks exchange its
   metadata (manifest, files, length; a rank that could not read sends length -1 and the step
   is skipped on every rank, said in the log and in status);
2. **Partners(n)**: each rank sends its stream to its n partners and receives the streams of
   the n ranks it is partner of, writing each as ``copy-r<src>/`` (a checkpoint directory, its
   manifest last). **Parity(k)** (rotating, hosts.py): in its group of k + 1 hosts, each rank
   sends piece (j - h - 1) mod (k + 1) of its stream to the member at position j and XORs the
   k pieces it receives into its own parity piece (ceil(longest / k) bytes), written with a
   JSON naming every member's manifest, files, length and the piece's xxh3;
3. each rank writes ``held-r<rank>.json`` (what it holds for N and each item's digest), last;
4. all ranks agree (a MIN all_reduce) that every rank wrote; then each writes
   ``protected-r<rank>.json``: the step is protected. The protection of older steps is then
   removed (only the newest protected step is protected; the own memory keeps keep_last steps).

**Behind: the newest step.** When the thread falls behind the saves (several steps queued), the
ranks agree (a MIN all_reduce of each rank's newest queued step) on the newest step every rank
has queued and protect that one; the older queued steps are superseded (never protected,
counted in status()'s ``superseded``), as the previous protected step stays protected until the
newer one is. The thread runs at a lowered CPU priority (``nice`` 10, as the drain), so on busy
cores it takes what training leaves; its reads reuse one buffer from step to step.

A kill anywhere before 4 leaves step N without ``protected`` markers: restore treats its copies
as absent and falls back to the previous protected step, whose copies are only removed after N
is protected. ``CKPTIO_TEST_PROTECT_PAUSE_S`` (test support) sleeps after the streams are read and
the step's directory made, so a test can kill ranks during encoding.

A transfer that fails (a peer killed: its connection closed; or silent for
``Options.peer_timeout_s``, the protection group's gloo timeout) raises RankFailedError naming
the peer; it is stored (raised once by wait()/protected()/close(), shown in status()), and the
protection stops: the group is unusable, so later steps fail at once (close() never waits for
another timeout). Restore (a new job) brings the lost hosts' ranks back.

Owns: the thread, its queue, its status and stored error. Does not own: placement (hosts.py),
the stream and transport (peers.py), restore (rebuild.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import CkptError, RankFailedError
from ckptio.tiering import marks, peers
from ckptio.tiering.hosts import Topology
from ckptio.tiering.marks import protected_steps
from ckptio.tiering.redundancy import Parity, Partners

__all__ = ["PAUSE_ENV", "Protector", "newest_protected"]

log = logging.getLogger("ckptio")
PAUSE_ENV = "CKPTIO_TEST_PROTECT_PAUSE_S"
NICE = 10  # the thread's CPU priority (as the drain's)


@dataclass
class _State:
    queue: list[int] = field(default_factory=list)
    busy: int | None = None
    protected: int | None = None
    seconds: float | None = None  # the last: from submit to protected
    skipped: list[int] = field(default_factory=list)
    superseded: int = 0  # queued steps passed over for a newer one (module docstring)
    error: str | None = None


class Protector:
    """The protection thread of one rank (module docstring). ``root``: the memory tier's local
    directory; ``own_dir(step)``: this rank's step directory."""

    def __init__(self, spec: Partners | Parity, topology: Topology, group: Any, rank: int,
                 root: str, own_dir: Any, timeout_s: float) -> None:
        self.spec, self.topology, self.group, self.rank = spec, topology, group, rank
        self.root, self._own_dir, self.timeout_s = root, own_dir, timeout_s
        self._broken: RankFailedError | None = None  # a transfer failed: the group is unusable
        self._cond = threading.Condition()
        self._state = _State(protected=newest_protected(root, rank))
        self._submitted: dict[int, float] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._buffer: torch.Tensor | None = None  # read_stream's, reused from step to step
        if isinstance(spec, Partners):
            topology.partners(rank, spec.n)  # refused here if the hosts are too few
        else:
            topology.groups(spec.k)

    def submit(self, step: int) -> None:
        """``step`` committed in this rank's memory: protect it (in order)."""
        with self._cond:
            self._state.queue.append(step)
            self._submitted[step] = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptio-protect",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every submitted step is protected or skipped (True) or ``timeout`` (False);
        raises the first error not raised yet, once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._state.queue or self._state.busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def close(self) -> None:
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()

    def status(self) -> dict[str, Any]:
        with self._cond:
            s = self._state
            return {"redundancy": self.spec.describe(), "protected": s.protected,
                    "protecting": s.busy, "queued": list(s.queue), "protect_seconds": s.seconds,
                    "unprotected": list(s.skipped), "superseded": s.superseded,
                    "protect_error": s.error}

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:  # Linux: per thread (the gloo group's own I/O threads keep theirs)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):
            log.debug("ckptio: the protection runs at normal priority (setpriority refused)")
        while True:
            with self._cond:
                while not self._state.queue and not self._closed:
                    self._cond.wait()
                if not self._state.queue:
                    return
                step = self._state.busy = self._state.queue[-1]
            try:
                step = self._agree(step)
                done = self._protect(step)
                error = None
            except Exception as exc:  # noqa: BLE001 - stored, raised once by wait()
                log.warning("ckptio: protecting step %d failed: %s: %s", step,
                            type(exc).__name__, exc)
                done, error = False, exc
            with self._cond:
                self._state.busy = None
                failed = [s for s in self._state.queue if s <= step] or [step]  # agree failed
                self._state.queue = [s for s in self._state.queue if s > step]
                if done:
                    self._state.protected = step
                    self._state.seconds = time.monotonic() - self._submitted.pop(step, 0.0)
                    self._state.error = None
                else:
                    self._state.skipped = [*self._state.skipped, *failed][-10:]
                    for s in failed:
                        self._submitted.pop(s, None)
                if error is not None:
                    self._state.error = f"step {step}: {type(error).__name__}: {error}"
                    if self._error is None:
                        self._error = error
                self._cond.notify_all()

    def _agree(self, newest: int) -> int:
        """The step every rank protects next: the oldest of the ranks' newest queued steps
        (collective); the older queued steps are superseded (module docstring)."""
        self._check_broken(newest)
        with self._talking(newest, "agreeing on the step to protect with", None):
            step = peers.agree_min(self.group, newest)
        with self._cond:
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
        """Steps 1-4 of the module docstring for ``step``; -> whether it is protected."""
        self._check_broken(step)
        try:
            stream: peers.Stream | None = peers.read_stream(self._own_dir(step), self._buffer)
            if self._buffer is None or stream.data.numel() > self._buffer.numel():
                self._buffer = stream.data  # sent and waited for before the next step's read
            meta: dict[str, Any] = {"step": step, **stream.meta()}
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
        directory = marks.held_dir(self.root, step)
        os.makedirs(directory, exist_ok=True)
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause:
            time.sleep(pause)
        ok = True
        try:
            if isinstance(self.spec, Partners):
                held = self._partners(stream, metas, directory)
            else:
                held = self._parity(stream, metas, directory)
            peers.write_json(os.path.join(directory, f"held-r{self.rank:05d}.json"),
                             {"step": step, "how": self.spec.describe(), "items": held})
        except RankFailedError:
            raise  # a peer gone: the group is unusable, no agreement can follow
        except (OSError, CkptError) as exc:
            log.warning("ckptio: rank %d could not keep its copies of step %d: %s", self.rank,
                        step, exc)
            ok = False
        with self._talking(step, "agreeing that every copy is written with", None):
            agreed = peers.all_ok(self.group, ok)
        if not agreed:
            return False
        peers.write_json(os.path.join(directory, f"protected-r{self.rank:05d}.json"),
                         {"step": step, "how": self.spec.describe()})
        self._drop_before(step)
        return True

    def _partners(self, stream: peers.Stream, metas: list[dict[str, Any]],
                  directory: str) -> list[dict[str, Any]]:
        """Send to the partners, receive from the partnered (every transfer done before any
        write, so a failed write never leaves a peer waiting), then write the copies."""
        n = self.spec.n  # type: ignore[union-attr]
        step = metas[self.rank]["step"]
        works = [(dst, peers.send(self.group, stream.data, dst))
                 for dst in self.topology.partners(self.rank, n)]
        got = []
        for src in self.topology.partnered(self.rank, n):
            with self._talking(step, "receiving a partner copy from", src):
                got.append((src, peers.recv(self.group, metas[src]["nbytes"], src)))
        self._wait(step, works)
        held = []
        for src, data in got:
            meta = metas[src]
            peers.write_checkpoint(os.path.join(directory, marks.copy_name(src)),
                                   meta["manifest"].encode(), [tuple(f) for f in meta["files"]],
                                   data)
            held.append({"kind": "copy", "rank": src, "manifest_digest": meta["digest"],
                         "digest": peers.digest(data)})
        return held

    def _parity(self, stream: peers.Stream, metas: list[dict[str, Any]],
                directory: str) -> list[dict[str, Any]]:
        """Rotating parity in this rank's group (hosts.py): send piece (j - me - 1) mod n of
        this rank's shard to the member at position j, XOR the pieces received into this
        rank's parity piece P_me, then write it with its xxh3 and every member's manifest."""
        k, topo = self.spec.k, self.topology  # type: ignore[union-attr]
        host, local = topo.host_of(self.rank), topo.local_of(self.rank)
        group = topo.group_of(host, k)
        members = [topo.rank_at(h, local) for h in topo.groups(k)[group]]
        n, me, step = len(members), topo.position(host, k), metas[self.rank]["step"]
        p = peers.piece_nbytes(max(metas[r]["nbytes"] for r in members), n - 1)
        works = [(dst, peers.send(self.group, peers.piece(stream.data, topo.contributed(j, me, n),
                                                          p), dst))
                 for j, dst in enumerate(members) if j != me]
        block = torch.zeros(p, dtype=torch.uint8)
        for h, src in enumerate(members):
            if h != me:
                size = peers.piece_len(metas[src]["nbytes"], topo.contributed(me, h, n), p)
                with self._talking(step, "receiving a parity piece from", src):
                    peers.xor_into(block, peers.recv(self.group, size, src))
        self._wait(step, works)
        name = os.path.join(directory, marks.parity_name(group, local))
        with open(f"{name}.bin", "wb") as f:
            f.write(memoryview(block.numpy()).cast("B") if block.numel() else b"")
        info = {"kind": "parity", "group": group, "local": local, "position": me,
                "nbytes": p, "digest": peers.digest(block),
                "members": [{"rank": r, "host": topo.host_of(r), "nbytes": metas[r]["nbytes"],
                             "manifest": metas[r]["manifest"], "files": metas[r]["files"],
                             "manifest_digest": metas[r]["digest"]} for r in members]}
        peers.write_json(f"{name}.json", info)
        return [{key: v for key, v in info.items() if key != "members"}]

    def _wait(self, step: int, works: list[tuple[int, Any]]) -> None:
        for dst, work in works:
            if work is not None:
                with self._talking(step, "sending to", dst):
                    work.wait()

    @contextmanager
    def _talking(self, step: int, what: str, peer: int | None) -> Iterator[None]:
        """A transfer with ``peer`` (None: a collective of every rank): its failure (a peer
        gone: connection closed, or no answer within peer_timeout_s) -> RankFailedError naming
        it; the group is then unusable, so the protection stops (later steps fail at once)."""
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError included)
            who = ("one of the job's ranks" if peer is None else
                   f"rank {peer} on {self.topology.describe(self.topology.host_of(peer))}")
            error = RankFailedError(
                f"rank {self.rank}: protecting step {step} across hosts failed {what} {who}: it "
                f"died or gave no answer within peer_timeout_s={self.timeout_s:g} s "
                f"({type(exc).__name__}: {exc}). Step {step} is not protected (the previous "
                "protected step is kept); the protection stops: restart the job (a restore "
                "brings lost hosts' ranks back)", () if peer is None else (peer,))
            self._broken = error
            raise error from exc

    def _drop_before(self, step: int) -> None:
        """Remove this host's protection of steps older than ``step`` (local rank 0 does)."""
        if self.topology.local_of(self.rank) != 0:
            return
        base = os.path.join(self.root, marks.REDUNDANCY_DIR)
        for name in os.listdir(base):
            n = _step_of(name)
            if n is not None and n < step:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _step_of(name: str) -> int | None:
    head, _, tail = name.partition("-")
    return int(tail) if head == "step" and tail.isdigit() else None


def newest_protected(root: str, rank: int) -> int | None:
    steps = protected_steps(root, rank)
    return steps[-1] if steps else None
