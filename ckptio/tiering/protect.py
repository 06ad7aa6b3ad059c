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
   manifest last). **Parity(k)**: each rank sends its stream to its group's parity holder; a
   holder XORs its group's streams (each padded to the longest) into one block, written with a
   JSON naming every member's manifest, files, length and the block's xxh3;
3. each rank writes ``held-r<rank>.json`` (what it holds for N and each item's digest), last;
4. all ranks agree (a MIN all_reduce) that every rank wrote; then each writes
   ``protected-r<rank>.json``: the step is protected. The protection of older steps is then
   removed (only the newest protected step is protected; the own memory keeps keep_last steps).

A kill anywhere before 4 leaves step N without ``protected`` markers: restore treats its copies
as absent and falls back to the previous protected step, whose copies are only removed after N
is protected. ``CKPTIO_TEST_PROTECT_PAUSE_S`` (test support) sleeps after the streams are read and
the step's directory made, so a test can kill ranks during encoding.

Owns: the thread, its queue, its status and stored error. Does not own: placement (hosts.py),
the stream and transport (peers.py), restore (rebuild.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import CkptError
from ckptio.tiering import marks, peers
from ckptio.tiering.hosts import Topology
from ckptio.tiering.marks import protected_steps
from ckptio.tiering.redundancy import Parity, Partners

__all__ = ["PAUSE_ENV", "Protector", "newest_protected"]

log = logging.getLogger("ckptio")
PAUSE_ENV = "CKPTIO_TEST_PROTECT_PAUSE_S"


@dataclass
class _State:
    queue: list[int] = field(default_factory=list)
    busy: int | None = None
    protected: int | None = None
    seconds: float | None = None  # the last: from submit to protected
    skipped: list[int] = field(default_factory=list)
    error: str | None = None


class Protector:
    """The protection thread of one rank (module docstring). ``root``: the memory tier's local
    directory; ``own_dir(step)``: this rank's step directory."""

    def __init__(self, spec: Partners | Parity, topology: Topology, group: Any, rank: int,
                 root: str, own_dir: Any) -> None:
        self.spec, self.topology, self.group, self.rank = spec, topology, group, rank
        self.root, self._own_dir = root, own_dir
        self._cond = threading.Condition()
        self._state = _State(protected=newest_protected(root, rank))
        self._submitted: dict[int, float] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
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
                    "unprotected": list(s.skipped), "protect_error": s.error}

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._state.queue and not self._closed:
                    self._cond.wait()
                if not self._state.queue:
                    return
                step = self._state.queue.pop(0)
                self._state.busy = step
            try:
                done = self._protect(step)
                error = None
            except Exception as exc:  # stored, raised once by wait(); later steps still tried
                log.warning("ckptio: protecting step %d failed: %s: %s", step,
                            type(exc).__name__, exc)
                done, error = False, exc
            with self._cond:
                self._state.busy = None
                if done:
                    self._state.protected = step
                    self._state.seconds = time.monotonic() - self._submitted.pop(step, 0.0)
                    self._state.error = None
                else:
                    self._state.skipped = [*self._state.skipped[-9:], step]
                if error is not None:
                    self._state.error = f"step {step}: {type(error).__name__}: {error}"
                    if self._error is None:
                        self._error = error
                self._cond.notify_all()

    def _protect(self, step: int) -> bool:
        """Steps 1-4 of the module docstring for ``step``; -> whether it is protected."""
        try:
            stream: peers.Stream | None = peers.read_stream(self._own_dir(step))
            meta: dict[str, Any] = {"step": step, **stream.meta()}
        except CkptError as exc:
            log.warning("ckptio: step %d cannot be protected on rank %d: %s", step, self.rank, exc)
            stream, meta = None, {"step": step, "nbytes": -1}
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
        except (OSError, CkptError) as exc:
            log.warning("ckptio: rank %d could not keep its copies of step %d: %s", self.rank,
                        step, exc)
            ok = False
        if not peers.all_ok(self.group, ok):
            return False
        peers.write_json(os.path.join(directory, f"protected-r{self.rank:05d}.json"),
                         {"step": step, "how": self.spec.describe()})
        self._drop_before(step)
        return True

    def _partners(self, stream: peers.Stream, metas: list[dict[str, Any]],
                  directory: str) -> list[dict[str, Any]]:
        n = self.spec.n  # type: ignore[union-attr]
        works = [peers.send(self.group, stream.data, dst)
                 for dst in self.topology.partners(self.rank, n)]
        held = []
        for src in self.topology.partnered(self.rank, n):
            meta = metas[src]
            data = peers.recv(self.group, meta["nbytes"], src)
            peers.write_checkpoint(os.path.join(directory, marks.copy_name(src)),
                                   meta["manifest"].encode(), [tuple(f) for f in meta["files"]],
                                   data)
            held.append({"kind": "copy", "rank": src, "manifest_digest": meta["digest"],
                         "digest": peers.digest(data)})
        for work in works:
            if work is not None:
                work.wait()
        return held

    def _parity(self, stream: peers.Stream, metas: list[dict[str, Any]],
                directory: str) -> list[dict[str, Any]]:
        k, topo = self.spec.k, self.topology  # type: ignore[union-attr]
        host, local = topo.host_of(self.rank), topo.local_of(self.rank)
        group = topo.group_of(host, k)
        holder = topo.rank_at(topo.parity_host(group, k), local)
        work = peers.send(self.group, stream.data, holder)
        held = []
        for g in topo.parity_groups_held(host, k):
            members = [topo.rank_at(h, local) for h in topo.groups(k)[g]]
            longest = max(metas[r]["nbytes"] for r in members)
            block = torch.zeros(longest, dtype=torch.uint8)
            for r in members:
                peers.xor_into(block, peers.recv(self.group, metas[r]["nbytes"], r))
            name = marks.parity_name(g, local)
            with open(os.path.join(directory, f"{name}.bin"), "wb") as f:
                f.write(memoryview(block.numpy()).cast("B") if longest else b"")
            info = {"kind": "parity", "group": g, "local": local, "nbytes": longest,
                    "digest": peers.digest(block),
                    "members": [{"rank": r, "host": topo.host_of(r), "nbytes": metas[r]["nbytes"],
                                 "manifest": metas[r]["manifest"], "files": metas[r]["files"],
                                 "manifest_digest": metas[r]["digest"]} for r in members]}
            peers.write_json(os.path.join(directory, f"{name}.json"), info)
            held.append({k2: v for k2, v in info.items() if k2 != "members"})
        if work is not None:
            work.wait()
        return held

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
