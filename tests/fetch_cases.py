"""Rank functions of tests/test_redundancy_fetch.py (importable by name: ranks are forked from
a clean forkserver): one rank per host (tests/redundancy_cases.py's hosts), a state of a few
MiB (so a rank's pieces span several of the transfers' chunks), saved and protected once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

import ckptio
from ckptio import Tier
from tests.redundancy_cases import OPTS, host_dir, restore_then_meet

MiB = 1 << 20


SPECS = {"partners": ckptio.Partners(1), "partners2": ckptio.Partners(2),
         "parity": ckptio.Parity(k=3),
         "parity2": ckptio.Parity(k=3, m=2)}


def _tiers(spec: str, disk: str) -> list[Tier]:
    return [Tier("shm://run", keep_last=2, redundancy=SPECS[spec]), Tier(disk, every=100)]


def _state(rank: int, mib: int) -> dict[str, Any]:
    """Each rank's own values, of unequal lengths (the shorter shards' pieces are padded)."""
    gen = torch.Generator().manual_seed(rank)
    return {"w": torch.randn((mib * MiB + rank * 4096) // 4, generator=gen), "step": 1}


def _host(rank: int, base: str) -> None:
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank)
    os.makedirs(host_dir(base, rank), exist_ok=True)


def step_nbytes(base: str, rank: int, step: int) -> int:
    """The bytes of ``rank``'s memory step (its data files: the stream peers send)."""
    where = os.path.join(host_dir(base, rank), "run", f"r{rank:05d}", f"step-{step}")
    return sum(e.stat().st_size for e in os.scandir(where) if e.name.startswith("data-"))


def save(rank: int, world: int, base: str, disk: str, spec: str, mib: int) -> int:
    """Save and protect step 1 -> its bytes in this rank's memory."""
    _host(rank, base)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    mgr.save(1, _state(rank, mib))
    mgr.protected()
    mgr.close()
    return step_nbytes(base, rank, 1)


def restore(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
            victim: int = -1) -> dict[str, Any]:
    """A fresh job restores -> whether bitwise, where from, the bytes received, or its error.
    ``victim``: that rank SIGKILLs itself when it first passes on a piece of the rebuild."""
    _host(rank, base)
    if rank == victim:
        from ckptio.redundancy import stripes

        def dies(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        stripes._sum = dies  # type: ignore[attr-defined]
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    started = time.monotonic()
    try:
        step = mgr.restore(state)
    except ckptio.errors.CkptError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    finally:
        mgr.close()
    return {"step": step, "bitwise": torch.equal(state["w"], _state(rank, mib)["w"]),
            "how": mgr.last_restore, "error": None}


def restore_some_leave(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
                       leave: tuple[int, ...], peer_timeout_s: float,
                       where: str = "stripes.run",
                       step_timeout_s: float = OPTS.step_timeout_s) -> dict[str, Any]:
    """restore() with ``peer_timeout_s`` and ``step_timeout_s``; the ranks of ``leave`` fail
    their part of the rebuild's transfers as they enter ``where`` (``module.function`` of
    ckptio.redundancy: torch's RuntimeError, as a link to a peer that died fails, before any
    receive is posted; ``protect.Protector.wait``: a CkptError, as the protection's error
    raised at the restore) and stay alive; every rank then meets the others at a barrier of the
    job's group (as a script's next collective) -> the error and the seconds its restore
    took."""
    _host(rank, base)
    if rank in leave:
        import importlib

        module, *names = where.split(".")
        owner = importlib.import_module(f"ckptio.redundancy.{module}")
        for each in names[:-1]:  # a class's method: protect.Protector.wait
            owner = getattr(owner, each)

        def fails(*args: Any, **kwargs: Any) -> Any:
            raise (RuntimeError if module != "protect" else ckptio.errors.CkptError)(
                f"rank {rank}: a link of the rebuild failed (test)")

        setattr(owner, names[-1], fails)
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    return restore_then_meet(_tiers(spec, disk), state, peer_timeout_s, step_timeout_s)


def restore_written_later(rank: int, world: int, base: str, disk: str, spec: str,
                          mib: int) -> dict[str, Any]:
    """restore(), each write of a step into this rank's memory tier held until its restore has
    returned (at most 20 s) -> also whether such a write waited for it, and whether step 1 is
    in this rank's memory tier after close()."""
    import threading

    from ckptio.redundancy import peers

    _host(rank, base)
    returned, seen = threading.Event(), {}
    write = peers.write_checkpoint

    def held(*args: Any, **kwargs: Any) -> Any:
        seen["after_restore"] = returned.wait(20)
        return write(*args, **kwargs)

    peers.write_checkpoint = held  # type: ignore[assignment]
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    step = mgr.restore(state)
    returned.set()
    mgr.close()
    where = os.path.join(host_dir(base, rank), "run", f"r{rank:05d}", "step-1", "manifest.json")
    return {"step": step, "bitwise": torch.equal(state["w"], _state(rank, mib)["w"]),
            "how": mgr.last_restore, "written_later": seen.get("after_restore"),
            "in_tier": os.path.exists(where)}


def restore_a_holder_dies(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
                          victim: int) -> dict[str, Any]:
    """restore(), rank ``victim`` SIGKILLing itself as it is about to send its share of a
    partner copy (the other holders send theirs)."""
    if rank == victim:
        from ckptio.redundancy import copy_fetch

        send = copy_fetch.send

        def dies(group: Any, me: int, fetches: list[Any], *args: Any) -> Any:
            if any(me in fetch.holders for fetch in fetches):
                os.kill(os.getpid(), signal.SIGKILL)
            return send(group, me, fetches, *args)

        copy_fetch.send = dies  # type: ignore[assignment]
    return restore(rank, world, base, disk, spec, mib)


def restore_a_rank_freezes(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
                           victim: int, where: str) -> dict[str, Any]:
    """restore() with rank_timeout_s=5, peer_timeout_s=5 and step_timeout_s=120, rank
    ``victim`` frozen (SIGSTOP: alive to the kernel, its connections open, no answer) at the
    restore's first gather (``where`` "inventory") or at the gather of its transfers' metadata
    ("transfer") -> the others' error and the seconds it took."""
    import dataclasses

    from ckptio.redundancy import rebuild

    if rank == victim:
        name = {"inventory": "inventory", "transfer": "_transfer"}[where]
        original = getattr(rebuild, name)

        def freezes(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGSTOP)
            return original(*args, **kwargs)

        setattr(rebuild, name, freezes)
    _host(rank, base)
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    options = dataclasses.replace(OPTS, rank_timeout_s=5.0, peer_timeout_s=5.0,
                                  step_timeout_s=120.0)
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=options)
    started = time.monotonic()
    try:
        mgr.restore(state)
    except ckptio.errors.CkptError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "ranks": list(getattr(exc, "ranks", ())), "untouched": not state["w"].any()}
    finally:
        mgr.close()
    return {"error": None}


def restore_counted(rank: int, world: int, base: str, disk: str, spec: str,
                    mib: int) -> dict[str, Any]:
    """restore(), counting during ``mgr.restore`` the bytes this rank hashed with xxh3 (the
    received step's check and the load's verify both hash through format/checksum.py) and the
    redundancy's gathers (peers.all_gather_json: inventory, items, outcomes...), the bytes
    of a step written into the memory tier by a write that began before the load had ended,
    and during ``mgr.restore`` and ``mgr.close`` (which ends a write begun after the load) the
    bytes copied into data files of a local tier (LocalStore.write_file), and whether a
    ``.rebuild-step-*`` directory is left in this rank's memory tier after close()."""
    import glob

    import xxhash

    from ckptio.format import checksum
    from ckptio.managing.level import TierSteps
    from ckptio.redundancy import peers
    from ckptio.storage.local.local_store import LocalStore

    counts = {"hashed": 0, "gathers": 0, "on": False, "loaded": False, "written_early": 0,
              "copied": 0, "copying": False}

    class Counted:
        def __init__(self) -> None:
            self.inner = xxhash.xxh3_64()

        def update(self, data: Any) -> None:
            counts["hashed"] += len(data) if counts["on"] else 0
            self.inner.update(data)

        def hexdigest(self) -> str:
            return str(self.inner.hexdigest())

    class Module:
        def __getattr__(self, name: str) -> Any:
            return Counted if name == "xxh3_64" else getattr(xxhash, name)

    gather = peers.all_gather_json

    def counted(*args: Any) -> Any:
        counts["gathers"] += 1 if counts["on"] else 0
        return gather(*args)

    load, write = TierSteps.try_load_at, peers.write_checkpoint

    def loaded(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        finally:
            counts["loaded"] = True

    def written(store: Any, manifest: bytes, files: Any, data: torch.Tensor,
                **kwargs: Any) -> None:
        counts["written_early"] += 0 if counts["loaded"] else data.numel()
        write(store, manifest, files, data, **kwargs)

    write_file = LocalStore.write_file

    def copied(store: Any, name: str, data: Any) -> None:
        if counts["copying"] and name.startswith("data"):
            counts["copied"] += memoryview(data).nbytes
        write_file(store, name, data)

    checksum.xxhash = Module()  # type: ignore[assignment]
    peers.all_gather_json = counted  # type: ignore[assignment]
    TierSteps.try_load_at = loaded  # type: ignore[method-assign]
    peers.write_checkpoint = written  # type: ignore[assignment]
    LocalStore.write_file = copied  # type: ignore[method-assign]
    _host(rank, base)
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    counts["on"] = counts["copying"] = True
    step = mgr.restore(state)
    counts["on"] = False
    mgr.close()
    counts["copying"] = False
    left = glob.glob(os.path.join(host_dir(base, rank), "run", f"r{rank:05d}", ".rebuild-*"))
    return {"step": step, "bitwise": torch.equal(state["w"], _state(rank, mib)["w"]),
            "how": mgr.last_restore, "hashed": counts["hashed"], "gathers": counts["gathers"],
            "written_early": counts["written_early"], "copied": counts["copied"],
            "scratch_left": left,
            "in_tier": os.path.exists(os.path.join(host_dir(base, rank), "run",
                                                   f"r{rank:05d}", "step-1", "manifest.json"))}


def chains_in_order(rank: int, world: int, lost: int, chunk: int) -> dict[str, Any]:
    """stripes.run on its own: a parity group of ``world`` members (one rank each), Parity
    m = 1, shards of unequal lengths, the member at ``lost`` rebuilt by the others, in chunks
    of ``chunk`` bytes -> this rank's sends and waits in the order it made them (("send", tag)
    or ("wait", tag)), the bytes it XORed in and received, and (the receiver) whether its
    shard came back bitwise."""
    import torch.distributed as dist

    from ckptio.redundancy import erasure, peers, stripes
    from ckptio.redundancy.topology import Topology

    stripes.CHUNK = chunk  # type: ignore[attr-defined]
    n, p = world, peers.piece_nbytes(10 * chunk + 3 * 8 * (world - 1), world - 1)
    shards = [torch.randint(0, 256, (10 * chunk + 3 * 8 * h,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(h)) for h in range(n)]
    block = torch.zeros(p, dtype=torch.uint8)  # P of stripe ``rank``: this rank holds it
    for h, i in Topology.stripe_data(rank, n, 1):
        piece = peers.piece(shards[h], i, p)
        peers.xor_into(block, piece)
    events: list[tuple[str, int]] = []
    counts = {"xored": 0}
    isend, irecv, mul_into = dist.isend, dist.irecv, erasure.mul_into

    class Waited:
        def __init__(self, work: Any, tag: int) -> None:
            self.work, self.tag = work, tag

        def wait(self) -> Any:
            events.append(("wait", self.tag))
            return self.work.wait()

    def sent(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
        events.append(("send", tag))
        return isend(tensor, dst, group=group, tag=tag)

    def received(tensor: Any, src: int, group: Any = None, tag: int = 0) -> Any:
        return Waited(irecv(tensor, src, group=group, tag=tag), tag)

    def xored(acc: Any, data: Any, c: int) -> None:
        counts["xored"] += data.numel()
        mul_into(acc, data, c)

    dist.isend, dist.irecv, erasure.mul_into = sent, received, xored  # type: ignore[assignment]
    chains = stripes.plan(list(range(n)), [lost], lost, 1, p, shards[lost].numel())
    out = torch.zeros(shards[lost].numel(), dtype=torch.uint8) if rank == lost else None
    outcome = stripes.run(dist.group.WORLD, rank, chains,
                          lambda kind: shards[rank] if kind == "data" else block, out)
    return {"events": events, "xored": counts["xored"], "received": outcome.received,
            "error": outcome.error, "starts": sum(
                -(-ch.length // chunk) for ch in chains if ch.terms[0].rank == rank),
            "bitwise": None if out is None else torch.equal(out, shards[lost])}


def restore_logged(rank: int, world: int, base: str, disk: str, spec: str, mib: int,
                   victim: int = -1) -> dict[str, Any]:
    """restore(), also -> this rank's memory tier directory listed once the manager is made
    (before its restore), the ckptio warnings logged, the error of close() and the scratch
    directories left after it. ``victim``: that rank (a lost one) SIGKILLs itself once the
    first chunk of its step has landed (in its scratch directory, on tmpfs)."""
    import glob
    import logging

    if rank == victim:
        from ckptio.redundancy.landing import StreamCheck

        landed = StreamCheck.landed

        def dies(check: StreamCheck, lo: int, hi: int) -> None:
            landed(check, lo, hi)
            os.kill(os.getpid(), signal.SIGKILL)

        StreamCheck.landed = dies  # type: ignore[method-assign]
    _host(rank, base)
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("ckptio").addHandler(Said(logging.WARNING))
    mine = os.path.join(host_dir(base, rank), "run", f"r{rank:05d}")
    state = {"w": torch.zeros_like(_state(rank, mib)["w"]), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_tiers(spec, disk), options=OPTS)
    listed = sorted(os.listdir(mine)) if os.path.isdir(mine) else []
    out: dict[str, Any] = {"listed": listed, "said": said, "error": None, "closed": None}
    try:
        out.update(step=mgr.restore(state), how=mgr.last_restore)
    except ckptio.errors.CkptError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    try:
        mgr.close()
    except ckptio.errors.CkptError as exc:
        out["closed"] = f"{type(exc).__name__}: {exc}"
    out["bitwise"] = torch.equal(state["w"], _state(rank, mib)["w"])
    out["scratch_left"] = glob.glob(os.path.join(mine, ".rebuild-*"))
    return out
