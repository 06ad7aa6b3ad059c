"""The training job of the recovery benchmark (benchmarks/recovery.py), run by torchrun on every
host: ``python -m benchmarks.recovery_worker CFG.json``.

Each rank trains its own stack of Linear layers with AdamW (its own seed: every rank's state
differs, as ZeRO shards do; one gloo all_reduce of the loss per step, the sync point through
which the survivors see a lost rank), on data that is a function of (seed, rank, step): a run
resumed from any step ends bitwise where an uninterrupted one does (``reference``). It saves
with one source (SOURCES), restores the newest step at start, and writes timestamped events
(``time.time()``: one clock across the namespaces of one machine) to its own JSONL file, which
the driver reads. A failure (a peer gone) is written and the process exits at once, as torchrun
expects of a failed worker.

Owns: the model, the data, the sources' save and restore, the worker's events, the digest.
Does not own: the hosts, the agents, the kill, the phases (recovery.py, recovery_report.py).
"""

from __future__ import annotations

import time

T0 = time.time()  # the process is up: before any import that takes time

import hashlib  # noqa: E402 - after T0 on purpose
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

SOURCES = ("partners", "parity", "disk", "dcp", "tcp")  # memory x2, ckptio disk, the peers
MEMORY = ("partners", "parity")
LAYERS = 8


class Events:
    """Appends one JSON line per event to ``<dir>/w<rank>-<pid>.jsonl``."""

    def __init__(self, root: str, rank: int) -> None:
        self.path = Path(root) / f"w{rank}-{os.getpid()}.jsonl"
        self.base = {"rank": rank, "pid": os.getpid(), "host": os.environ.get("BENCH_HOST"),
                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}

    def __call__(self, ev: str, t: float | None = None, **extra: Any) -> None:
        line = json.dumps({"t": time.time() if t is None else t, "ev": ev, **self.base, **extra})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def width(mb: float) -> int:
    """The layers' width for a state of ``mb`` MiB (parameters + AdamW's two moments)."""
    params = mb * (1 << 20) / 12 / LAYERS
    return max(8, int(params ** 0.5))


def build(cfg: dict[str, Any], rank: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(cfg["seed"] * 1000 + rank)
    w = width(cfg["mb"])
    layers: list[Any] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(w, w), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(cfg: dict[str, Any], rank: int, step: int, model: Any, opt: Any) -> Any:
    """One step on the batch of (seed, rank, step) -> the loss."""
    import torch

    gen = torch.Generator().manual_seed((cfg["seed"] * 1_000_003 + rank) * 100_003 + step)
    w = width(cfg["mb"])
    x = torch.randn(cfg["batch"], w, generator=gen)
    target = torch.randn(cfg["batch"], w, generator=gen)
    loss = (model(x) - target).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def digest(model: Any, opt: Any) -> str:
    """sha256 of every parameter and every optimizer state tensor, in a fixed order."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for key in sorted(opt.state.get(p, {})):
            value = opt.state[p][key]
            h.update(key.encode() + value.detach().contiguous().reshape(-1)
                     .view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference(cfg: dict[str, Any], rank: int) -> str:
    """The digest of rank ``rank``'s state after an uninterrupted run of ``cfg["steps"]``."""
    model, opt = build(cfg, rank)
    for step in range(1, cfg["steps"] + 1):
        train_step(cfg, rank, step, model, opt)
    return digest(model, opt)


# ------------------------------------------------------------------ sources


class Ckptio:
    """ckptio's CheckpointManager: memory every step (Partners(1) or Parity(k)) drained to the
    disk every ``every`` steps, or the disk tier alone every ``every`` steps."""

    def __init__(self, cfg: dict[str, Any], rank: int, model: Any, opt: Any) -> None:
        import ckptio

        disk = os.path.join(cfg["dir"], "disk")
        source = cfg["source"]
        if source in MEMORY:
            red = ckptio.Partners(1) if source == "partners" else ckptio.Parity(k=cfg["k"])
            tiers = [ckptio.Tier("shm://run", keep_last=1, redundancy=red),  # + the protected
                     ckptio.Tier(disk, every=cfg["every"], keep_last=2)]
        else:
            tiers = [ckptio.Tier(disk, keep_last=2)]
        self.every = 1 if source in MEMORY else cfg["every"]
        self.memory = source in MEMORY
        self.mgr = ckptio.CheckpointManager(tiers=tiers)
        self.state = {f"rank{rank}": {"model": model, "optim": opt}, "step": 0}

    def restore(self) -> tuple[int, str]:
        step = self.mgr.restore(self.state)
        info = self.mgr.last_restore or {}
        where = info.get("source") or ("disk" if info.get("tier") is not None else "?")
        return step or 0, str(where) if step else "none"

    def save(self, step: int) -> None:
        if step % self.every == 0:
            self.state["step"] = step
            self.mgr.save(step, self.state, force=True)

    def settle(self) -> None:
        """The newest step protected across hosts (memory) before the driver's kill."""
        if self.memory:
            self.mgr.protected(timeout=300)

    def close(self) -> None:
        self.mgr.close()


class Peer:
    """DCP (``dcp.save`` / ``dcp.load`` of one global checkpoint, each rank's keys its own) or
    torch_checkpointing (its sync CheckpointManager: each rank its own file, rank 0 renames the
    step's directory into place after its barrier), to the disk every ``every`` steps; a step
    counts once committed (DCP's .metadata written, tc's directory in place)."""

    def __init__(self, cfg: dict[str, Any], rank: int, model: Any, opt: Any) -> None:
        self.cfg, self.rank, self.model, self.opt = cfg, rank, model, opt
        self.root = Path(cfg["dir"]) / "disk"
        self.dcp = cfg["source"] == "dcp"
        self.first = 0  # the step resumed from

    def _tc(self, step: int) -> Any:
        """torch_checkpointing's sync manager (as ckptio/testing/tc_peer.py makes it), its
        barrier's generation named by the step resumed from and the step: its default (the
        agent's restart count and a counter) differs on a replacement host, whose agent's
        count starts at 0, and the first save after the resume then waits forever."""
        from torch_checkpointing.barriers import DefaultStoreBarrierConfig
        from torch_checkpointing.checkpoint_manager import CheckpointManager
        from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        barrier = DefaultStoreBarrierConfig(generation=f"from{self.first}.{step}")
        return CheckpointManager(CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(
                writer_config=CheckpointWriterConfig(barrier_config=barrier)),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)  # the optimizer's state made first
        return {f"rank{self.rank}": {"model": msd, "optim": osd}}

    def _done(self, step: int) -> bool:
        where = self.root / f"step-{step}"  # DCP: rank 0 writes .metadata last; tc: rank 0
        return (where / ".metadata").exists() if self.dcp else where.is_dir()  # renames last

    def restore(self) -> tuple[int, str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        steps = sorted((int(p.name[5:]) for p in self.root.glob("step-*")), reverse=True) \
            if self.root.exists() else []
        step = next((s for s in steps if self._done(s)), 0)
        if not step:
            return 0, "none"
        state = self._state()
        where = self.root / f"step-{step}"
        if self.dcp:
            dcp.load(state, checkpoint_id=str(where))
        else:
            self._tc(step).load(str(where), into={"state": state})
            self.first = step
        mine = state[f"rank{self.rank}"]
        set_state_dict(self.model, self.opt, model_state_dict=mine["model"],
                       optim_state_dict=mine["optim"])
        return step, "disk"

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if step % self.cfg["every"]:
            return
        where = self.root / f"step-{step}"
        if self.dcp:
            dcp.save(self._state(), storage_writer=dcp.FileSystemWriter(str(where),
                                                                        sync_files=True))
        else:
            self._tc(step).save(str(where), {"state": self._state()})  # its state_<rank>.pt
        os.sync()

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ the job


def import_source(source: str) -> None:
    """The source's library imported before "imported" (as a job imports what it uses; ckptio
    imports its modules lazily, so its manager is named here)."""
    import importlib

    names = {"dcp": ["torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"],
             "tcp": ["torch.distributed.checkpoint.state_dict",
                     "torch_checkpointing.checkpoint_manager"]}.get(source, ["ckptio.managing.manager"])
    for name in names:
        importlib.import_module(name)


def run(cfg: dict[str, Any], ev: Events) -> None:
    import torch
    import torch.distributed as dist

    import_source(cfg["source"])
    ev("imported")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    host = int(os.environ["BENCH_HOST"])
    if cfg["kill"] == "host" and rank != host:  # ranks follow the hosts' sorted addresses
        raise RuntimeError(f"rank {rank} on host {host}: the rendezvous renumbered the hosts")
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["pg_timeout"]))
    ev("pg")
    model, opt = build(cfg, rank)
    ev("built")
    engine: Ckptio | Peer = (Ckptio if cfg["source"] in ("partners", "parity", "disk")
                             else Peer)(cfg, rank, model, opt)
    ev("engine")
    first, where = engine.restore()
    ev("restored", step=first, source=where)
    for step in range(first + 1, cfg["steps"] + 1):
        loss = train_step(cfg, rank, step, model, opt)
        if step == cfg["kill_step"] + 1 and not first and rank == cfg["victim"]:
            ev("hold")  # the kill comes mid-run, however short a step: the others wait here
            time.sleep(cfg["hold_s"])
        dist.all_reduce(loss)
        ev("step", step=step)
        engine.save(step)
        if step == cfg["kill_step"] and not first:
            engine.settle()
            dist.barrier()
            ev("ready", step=step)
    engine.close()
    ev("final", digest=digest(model, opt))
    dist.destroy_process_group()


def fail_fast(ev: Events, body: Callable[[], object]) -> int:
    """Run a worker's ``body``; any error is written down as an event, then the process exits
    at once (no interpreter teardown that could hang on a dead peer's group)."""
    ev("start", t=T0)
    try:
        body()
    except BaseException as exc:  # noqa: BLE001 - written down, then the worker fails at once
        ev("error", what=f"{type(exc).__name__}: {str(exc)[:500]}")
        sys.stderr.flush()
        os._exit(1)
    return 0


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[0]).read_text())
    ev = Events(cfg["events"], int(os.environ["RANK"]))
    return fail_fast(ev, lambda: run(cfg, ev))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
