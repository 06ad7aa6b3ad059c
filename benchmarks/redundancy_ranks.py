"""The per-rank bodies of the redundancy benchmark (benchmarks/redundancy.py), run on the hosts of
ckptio.testing.multihost by its agents (module-level functions: the ranks import them by name).

train_rank: each rank trains its own GPT (benchmarks/train.py: its own seed, so every rank's
state differs, as ZeRO shards do), one gloo all_reduce of the loss per step (the sync point a
data-parallel job has), and checkpoints after every step with the engine: ckptio tiers (memory
every step, disk every K) with redundancy off / partner copies / parity, or NVRx's local
checkpoints with CliqueReplicationStrategy. restore_rank: a fresh model and optimizer, the
checkpoint restored after the driver wiped a host (or every host's memory), timed.

Owns: the engines' setup, the training loop, the restore and their records. Does not own: the
hosts, the schedule, the report (redundancy.py, redundancy_report.py).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

NVRX = "nvrx_clique"
COLS = 4096  # the columns of a --sharded state's tensors
TIERED = ("off", "partners", "partners2", "parity", "parity2")


def redundancy_of(engine: str, k: int) -> Any:
    """The ``redundancy=`` of the memory tier for a ckptio engine (None: off); a trailing 2:
    two copies, or two parity pieces."""
    import ckptio

    if engine == "off":
        return None
    two = engine.endswith("2")
    if engine.startswith("partners"):
        return ckptio.Partners(2 if two else 1)
    return ckptio.Parity(k=k, m=2 if two else 1)


def _manager(cfg: dict[str, Any]) -> Any:
    """The ckptio engines' manager. ``off``: a memory tier on several hosts needs redundancy
    (without it the manager refuses), so each rank keeps the same rank-local layout that
    redundancy uses (``run/r<rank>/step-N``, disk ``r<rank>/step-N``) through a manager of its
    own on a one-rank group: the same bytes written, nothing protected across hosts."""
    import torch.distributed as dist

    import ckptio

    disk = Path(cfg["dir"]) / "disk"
    redundancy = redundancy_of(cfg["engine"], cfg["k"])
    if redundancy is not None:
        return ckptio.CheckpointManager(tiers=[
            ckptio.Tier("shm://run", keep_last=1, redundancy=redundancy),
            ckptio.Tier(str(disk), every=cfg["every"], keep_last=1)])
    from ckptio.distributed.dist import mark_piece

    mine, _all = dist.new_subgroups(group_size=1)
    mark_piece(mine, dist.get_rank(), dist.get_world_size())  # a sharded state's own shards
    tag = f"r{dist.get_rank():05d}"
    return ckptio.CheckpointManager(tiers=[
        ckptio.Tier(f"shm://run/{tag}", keep_last=1),
        ckptio.Tier(str(disk / tag), every=cfg["every"], keep_last=1)], process_group=mine)


def _nvrx(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """NVRx LocalCheckpointManager with CliqueReplicationStrategy (jump = ranks per host, factor
    2: each rank's clique partner on the next host), its state dict subclassed to let CPU tensors
    through (docs/BENCH_TIERS.md)."""
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict,
    )
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    class CpuStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
        def __init__(self, state_dict: dict[str, Any]) -> None:
            self.state_dict, self._is_hollow = state_dict, False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:
            pass

    CpuStateDict.__qualname__ = CpuStateDict.__name__ = "CpuStateDict"  # pickled by reference
    globals()["CpuStateDict"] = CpuStateDict
    strategy = CliqueReplicationStrategy.from_replication_params(
        replication_jump=int(os.environ["LOCAL_WORLD_SIZE"]), replication_factor=2)
    root = Path(os.environ["CKPTIO_SHM_DIR"]) / "nvrx"
    return LocalCheckpointManager(str(root), session_id="bench", repl_strategy=strategy), \
        CpuStateDict


def _protect_seconds(mgr: Any, seen: dict[int, float]) -> None:
    """Note the newest protected step's time from its memory commit to protected (the
    manager's ``protect_seconds``), once per step."""
    tier = mgr.status()[0]
    newest, took = tier.get("protected"), tier.get("protect_seconds")
    if newest is not None and took is not None and newest not in seen:
        seen[newest] = took


def _gpt_job(rank: int, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Each rank's own GPT: (step(i): one training step, state(i): what it checkpoints)."""
    from benchmarks.train import build_training, checkpoint_state, train_step

    model, opt, mcfg = build_training(cfg["gb"], cfg["seed"] + rank)
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)
    tokens = torch.randint(mcfg.vocab, (cfg["steps"], cfg["batch"], cfg["seq"] + 1),
                           generator=gen)
    return (lambda i: train_step(model, opt, tokens[i - 1]),
            lambda i: checkpoint_state(model, opt, i, cfg["batch"]))


def _rows(cfg: dict[str, Any], world: int) -> int:
    """The rows of each tensor of a ``--sharded`` state saved by ``world`` ranks."""
    return max(world, int(cfg["gb"] * world * 1e9 / 4 / COLS / 8) // world * world)


def _locals(rank: int, world: int, cfg: dict[str, Any], step: int) -> list[torch.Tensor]:
    """Rank ``rank``'s 8 shards (of a job of ``world`` ranks) after ``step`` steps (each adds
    1/1024 to every element: exact)."""
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)
    out = []
    for _ in range(8):
        local = torch.rand(_rows(cfg, world) // world, COLS, generator=gen)
        for _ in range(step):  # the same additions as the job's steps: bitwise equal
            local.add_(1 / 1024)
        out.append(local)
    return out


def sharded_state(rank: int, world: int, cfg: dict[str, Any], step: int) -> dict[str, Any]:
    """``--sharded``: a state of ``gb x world`` GB in 8 float32 tensors, each Shard(0) over
    every rank (an FSDP2 job's layout; no training compute: the checkpoint is what is
    measured), as it is after ``step`` steps. ``cfg["saved_world"]``, when set: the job that
    saved it had that many ranks; this rank then holds its share of that job's tensors,
    as it should be after resharding (its rows of the old ranks' shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    old = cfg.get("saved_world") or world
    rows = _rows(cfg, old)
    if old == world:
        shards = _locals(rank, world, cfg, step)
    else:
        sizes = [len(c) for c in torch.arange(rows).chunk(world)]
        lo, per = sum(sizes[:rank]), rows // old
        hi = lo + sizes[rank]
        parts: list[list[torch.Tensor]] = [[] for _ in range(8)]
        for k in range(lo // per, (hi - 1) // per + 1):
            for i, local in enumerate(_locals(k, old, cfg, step)):
                parts[i].append(local[max(lo, k * per) - k * per:min(hi, (k + 1) * per) - k * per])
        shards = [torch.cat(p) for p in parts]
    state = {f"w{i}": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                         shape=torch.Size((rows, COLS)), stride=(COLS, 1))
             for i, local in enumerate(shards)}
    return {"model": state, "step": step}


def _sharded_job(rank: int, world: int, cfg: dict[str, Any]) -> tuple[Any, Any]:
    state = sharded_state(rank, world, cfg, 0)

    def step(_i: int) -> None:
        for value in state["model"].values():
            value.to_local().add_(1 / 1024)

    def checkpoint(i: int) -> dict[str, Any]:
        state["step"] = i
        return state
    return step, checkpoint


def train_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks.engines import release_free_heap, reset_peak_rss, status_kib
    from ckptio.tuning import state as gpt_state

    torch.set_num_threads(1)
    train_step, checkpoint_state = (_sharded_job(rank, world, cfg) if cfg.get("sharded")
                                    else _gpt_job(rank, cfg))
    engine = cfg["engine"]
    mgr = nvrx = None
    if engine in TIERED:
        mgr = _manager(cfg)
    elif engine == NVRX:
        nvrx, wrap = _nvrx(cfg)
    release_free_heap()
    dist.barrier()
    reset_peak_rss()
    rss_before = status_kib("VmRSS")
    step_s, call_s, protected = [], [], {}
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        train_step(step)
        dist.all_reduce(torch.zeros(1))
        step_s.append(time.perf_counter() - t0)
        if engine == "none":
            continue
        state = checkpoint_state(step)
        t0 = time.perf_counter()
        if mgr is not None:
            mgr.save(step, state, asynchronous=cfg["asynchronous"], force=True)
        else:  # NVRx empties the dicts it is given (pop_tensors): a copy of their structure
            nvrx.save(wrap(_structure(state)), iteration=step, is_async=False)
        call_s.append(time.perf_counter() - t0)
        if mgr is not None and cfg["engine"] != "off":  # outside the clock
            _protect_seconds(mgr, protected)
    t0 = time.perf_counter()
    record: dict[str, Any] = {}
    if mgr is not None:
        mgr.close()
        record["close_s"] = time.perf_counter() - t0
        if cfg["engine"] != "off":
            _protect_seconds(mgr, protected)
        record["status"] = _jsonable(mgr.status())
    final = checkpoint_state(cfg["steps"])
    nbytes = (sum(v.to_local().nbytes for v in final["model"].values()) if cfg.get("sharded")
              else gpt_state.tensor_nbytes(final))
    return {"rank": rank, "host": int(os.environ["GROUP_RANK"]), "bytes": nbytes,
            "step_s": step_s, "call_s": call_s, "train_s": sum(step_s) + sum(call_s),
            "protected_s": list(protected.values()), "rss_extra_mib": (status_kib("VmHWM") - rss_before) / 1024,
            "last_step": cfg["steps"], **record}


def restore_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A fresh process restores the newest step; timed; the tier / source it came from."""
    import gc

    from benchmarks.train import build_training, checkpoint_state

    torch.set_num_threads(1)
    if cfg.get("sharded"):
        state = sharded_state(rank, world, cfg, 0)
        for value in state["model"].values():
            value.to_local().zero_()
    else:
        model, opt, _ = build_training(cfg["gb"], cfg["seed"] + 1000 + rank)
        for p in model.parameters():  # AdamW's state exists after a step: restore fills it
            p.grad = torch.zeros_like(p)
        opt.step()
        state = checkpoint_state(model, opt, -1, cfg["batch"])
    engine = cfg["engine"]
    gc.collect()
    gc.freeze()
    try:
        if engine == NVRX:
            return _nvrx_restore(cfg)
        mgr = _manager(cfg)
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        if engine == "off":  # one manager per rank: the ranks agree on the step they all have
            newest = torch.tensor([mgr.latest() or 0])
            dist.all_reduce(newest, op=dist.ReduceOp.MIN)
            step = mgr.restore(state, step=int(newest)) if int(newest) else None
        else:
            step = mgr.restore(state)
        took = time.perf_counter() - t0
        info = getattr(mgr, "last_restore", None) or {}
        mgr.close()
        source = info.get("source") or ("own" if info.get("tier") == 0 else "disk")
        if cfg.get("sharded") and step is not None:  # bitwise against the step recomputed
            want = sharded_state(rank, world, cfg, step)["model"]
            bitwise = all(torch.equal(state["model"][k].to_local(), v.to_local())
                          for k, v in want.items())
            info = {**info, "bitwise": bitwise}
        return {"rank": rank, "host": int(os.environ["GROUP_RANK"]), "ok": True, "step": step,
                "restore_s": took, "source": source, "last_restore": _jsonable(info)}
    except Exception as exc:  # noqa: BLE001 - recorded: the report says what failed and where
        return {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "where": _where(exc)}


def _nvrx_restore(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    nvrx, _wrap = _nvrx(cfg)
    dist.barrier()
    t0 = time.perf_counter()
    try:
        iteration = nvrx.find_latest()
        nvrx.load()
    except Exception as exc:  # noqa: BLE001 - recorded (CPU: NVRx's retrieval calls .cuda())
        return {"rank": dist.get_rank(), "ok": False, "error": f"{type(exc).__name__}: {exc}",
                "where": _where(exc)}
    return {"rank": dist.get_rank(), "host": int(os.environ["GROUP_RANK"]), "ok": True,
            "step": iteration, "restore_s": time.perf_counter() - t0, "source": "nvrx"}


def _structure(value: Any) -> Any:
    """Dicts and lists copied, tensors shared (opt.state_dict() hands out the live per-parameter
    dicts)."""
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_structure(v) for v in value]
    return value


def _where(exc: BaseException) -> str:
    """The innermost frame outside torch: file (from site-packages on) and line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "contextlib" not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    name = f.filename.split("site-packages/")[-1]
    return f"{name}:{f.lineno} ({(f.line or '').strip()})"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(value))
    return repr(value)
