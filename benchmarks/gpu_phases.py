"""The GPU benchmark's training and load phases, each run in its own fresh process.

Owns: the timed training loop on the device (forward+backward, optimizer step and checkpoint
call timed apart; the loss read back every step, as a loop that logs it does), which saver each
engine name makes, the bitwise check of the last checkpoint, and the cold loads into CUDA
tensors with the read ceiling. Does not own: the trainer and peers (gpu_engines.py), the save
timeline (train.py), the driver (gpu.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_engines as ge
from benchmarks.train_engines import Context
from ckptio.tuning.state import tensor_leaves, tensor_nbytes

Run = dict[str, Any]
WARMUP = 3


def make_saver(name: str, trainer: ge.Trainer, nbytes: int, args: argparse.Namespace) -> Any:
    from benchmarks import train_engines

    ctx = Context(trainer.opt, 0)
    if name in ("ckptio_tiers", "ckptio_tiers_ready"):  # the memory tier every step, every
        # 10th drained to --dir; _ready: prepare(state, wait=True) at startup
        return ge.TierSaver(ctx, trainer.model, args.shm_dir / "tier",
                            args.dir / f"tier-r{args.rep}", trainer.state(0),
                            wait=name == "ckptio_tiers_ready")
    if name == "ckptio_eager":
        return train_engines.CkptioSaver(ctx, lazy=False)
    if name in ("ckptio_lazy", "ckptio_lazy_sized"):  # the bf16 weights change only after
        saver = train_engines.CkptioSaver(ctx, lazy=True)  # the step (copied from masters)
        saver.after_step = [trainer.model]
        if name == "ckptio_lazy_sized":  # the pool sized for the state at startup, as
            # DataStates' cache is given its size
            saver.checkpointer.prepare(str(args.dir), state=trainer.state(0), wait=True)
        return saver
    if name == "dcp_async_best":
        return ge.dcp_best(ctx)
    if name == "datastates":
        return ge.DataStatesSaver(ctx, int(nbytes * 1.05) + (64 << 20))
    raise ValueError(f"unknown engine {name!r}")


def pinned_bytes(name: str, saver: Any) -> int:
    if name.startswith("ckptio"):
        return ge.ckptio_pinned_bytes(saver)
    if name == "dcp_async_best":
        return ge.dcp_pinned_bytes(saver)
    return int(saver.cache_bytes) if name == "datastates" else 0


def train_worker(args: argparse.Namespace, trainer: ge.Trainer) -> Run:
    from benchmarks.train import SaveTimeline

    root = (args.shm_dir if args.every == 1 else args.dir) / f"{args.engine}-r{args.rep}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for _ in range(WARMUP):
        trainer.forward_backward()
        trainer.optimizer_step()
    nbytes = tensor_nbytes(trainer.state(0))
    saver = None if args.engine == "none" else make_saver(args.engine, trainer, nbytes, args)
    timeline = SaveTimeline(saver, root) if saver is not None else None
    steps = args.steps if args.every > 1 else max(6, args.steps // 3)
    when = set(range(args.every, steps, args.every)) if args.every > 1 else set(range(3, steps))
    rows: list[dict[str, float]] = []
    last: dict[str, Any] = {}
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = trainer.forward_backward()
        t1 = time.perf_counter()
        trainer.optimizer_step()
        t2 = time.perf_counter()
        loss.item()  # the loop's one synchronisation: it logs the loss
        rows.append({"fwdbwd_s": t1 - t0, "opt_s": t2 - t1, "step_s": time.perf_counter() - t0})
        if timeline is None or step not in when:
            continue
        state = trainer.state(step)
        # untimed: the state as saved (DataStates': its bytes in the order it writes them)
        reference = (_written_order_digest(state) if args.engine == "datastates" else
                     _digest(state)) if step == max(when) else ""
        path = timeline.save(state, step)
        last = {"digest": reference, "state": state, "path": path} if reference else last
    final_wait_s = timeline.finish() if timeline is not None else 0.0
    run: Run = {"bytes": nbytes, "steps": rows, "when": sorted(when), "final_wait_s": final_wait_s,
                "checkpoints": timeline.records if timeline else []}
    if saver is not None:
        run["pinned_bytes"] = pinned_bytes(args.engine, saver)
        run["bitwise_ok"] = _check_last(args.engine, saver, last)
        if isinstance(saver, ge.TierSaver):
            run["memory_tier_bytes"] = saver.memory_bytes()
        saver.close()
    shutil.rmtree(root, ignore_errors=True)
    return run


def _digest(state: Any) -> str:
    from ckptio.tuning.state import digest

    return digest(state)


def _check_last(engine: str, saver: Any, last: dict[str, Any]) -> bool:
    """The last checkpoint, read back by the engine's own loader (DataStates: its file's bytes
    against the tensors in the order it wrote them), equals the state when it was saved."""
    from benchmarks import engines
    from ckptio.tuning.state import empty_destination

    path: Path = last["path"]
    if isinstance(saver, ge.TierSaver):
        path = saver.path_of(int(path.name.rsplit("-", 1)[1]))
    if engine == "datastates":
        import xxhash

        return xxhash.xxh3_64((path / "rank0.bin").read_bytes()).hexdigest() == last["digest"]
    dest = empty_destination(last["state"])
    engines.ENGINES["ckptio" if engine.startswith("ckptio") else "dcp_t1"].load(path, dest)
    return _digest(dest) == last["digest"]


def _written_order_digest(state: Any) -> str:
    """xxh3 of the tensors' bytes in the order DataStatesSaver writes them into its file."""
    import xxhash

    h = xxhash.xxh3_64()
    for t in ge.written_tensors(state):
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def blocked(run: Run) -> list[float]:
    """Per checkpoint: the save call, the wait for the previous save before it, and what the
    next optimizer step took beyond the run's own median step before any checkpoint."""
    rows, when = run["steps"], run["when"]
    base = statistics.median(r["opt_s"] for r in rows[: when[0] - 1] or rows)
    out, records = [], run["checkpoints"]
    for i, record in enumerate(records):
        step = record["step"]
        hook = rows[step]["opt_s"] - base if step < len(rows) else 0.0
        before = records[i - 1].get("wait_after_s", 0.0) if i else 0.0
        out.append(record["call_s"] + before + max(0.0, hook))
    return out


# ---------------------------------------------------------------- loads


def load_setup(args: argparse.Namespace, trainer: ge.Trainer) -> Run:
    """One state saved by every loader's own engine (untimed), and its digest."""
    from benchmarks import engines

    root = args.dir / "load"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    trainer.forward_backward()
    trainer.optimizer_step()
    state = trainer.state(1)
    for name, engine in (("ckptio", "ckptio"), ("dcp", "dcp_t4"), ("torch_save", "torch_save")):
        engines.ENGINES[engine].save(state, root / name)
    return {"digest": _digest(state), "bytes": tensor_nbytes(state)}


def load_worker(args: argparse.Namespace, trainer: ge.Trainer) -> Run:
    """Page cache dropped, then the engine's load into the trainer's CUDA state, in place."""
    from benchmarks import engines
    from ckptio.tuning import ceiling

    root = args.dir / "load"
    trainer.forward_backward()  # other values than the checkpoint's, moments allocated
    trainer.optimizer_step()
    dest = trainer.state(1)
    for name in ("ckptio", "dcp", "torch_save"):
        engines.ENGINES[{"dcp": "dcp_t1"}.get(name, name)].prepare()
    if args.engine == "ceiling":
        return _read_ceiling(root / "ckptio")
    files = [p for p in (root / args.engine).rglob("*") if p.is_file()]
    dropped = ceiling.drop_page_cache(files)
    time.sleep(1.0)
    key = {"dcp": "dcp_t1"}.get(args.engine, args.engine)
    ge.sync()
    t0 = time.perf_counter()
    engines.ENGINES[key].load(root / args.engine, dest)
    ge.sync()
    seconds = time.perf_counter() - t0
    on_device = all(t.device.type == trainer.device.type for _, t in tensor_leaves(dest))
    return {"load_s": seconds, "cache_drop": dropped, "digest": _digest(dest),
            "on_device": on_device}


def _read_ceiling(ckpt: Path) -> Run:
    """Cold O_DIRECT read of as many bytes as the ckptio checkpoint holds (best geometry)."""
    from ckptio.tuning import ceiling

    nbytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    path = ckpt.parent / "ceiling.bin"
    tries = []
    try:
        for chunk, threads in ceiling.GEOMETRIES:
            w = ceiling.write_ceiling(path, nbytes, chunk, threads)
            r = ceiling.read_ceiling(path, 1.0, chunk, threads)
            tries.append({"chunk": chunk, "threads": threads, "write_s": w["seconds"],
                          "read_s": r["seconds"], "cache_drop": r["cache_drop"]})
    finally:
        path.unlink(missing_ok=True)
    return {"bytes": nbytes, "read_s": min(t["read_s"] for t in tries),
            "write_s": min(t["write_s"] for t in tries), "geometries": tries,
            "cache_drop": tries[0]["cache_drop"]}


def remove_load_files(args: argparse.Namespace) -> None:
    shutil.rmtree(args.dir / "load", ignore_errors=True)
    os.sync()
