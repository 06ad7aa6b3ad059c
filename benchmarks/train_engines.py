"""Checkpoint engines as a training loop drives them: start a save, learn when it is durable,
load it back.

Owns: how each engine is started from a training loop (blocking or asynchronous) at its best
documented settings, what "durable" costs each one (os.sync() added where an engine does not
fsync), the 1-rank gloo process group DCP's async_save needs, the ckptio staging-pool size, and
why an engine cannot run here. Does not own: the training loop, timing and protocol (train.py),
or the loaders, which are those of the save/load benchmark (engines.py).

Every engine is a factory make(Context) -> Saver. Saver.start(state, path) returns when the
training loop may continue, with a Pending: how to learn that the save is durable and what the
engine reports about itself.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import math
import mmap
import os
import socket
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from benchmarks import engines

LoadFn = Callable[[Path, Any], object]
DCP_THREADS = 2  # FileSystemWriter thread_count: one per core of this 2-core machine
CKPTIO_FIELDS = ("blocked_s", "capture_s", "persist_s", "total_s", "skipped", "nbytes")


@dataclass(frozen=True)
class Context:
    optimizer: torch.optim.Optimizer  # ckptio_lazy hooks its step
    pool_bytes: int  # ckptio's staging pool


def _nothing() -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Pending:
    """A started save. ``durable`` blocks until every byte is durable and is safe to run on a
    helper thread, which timestamps it; None where only the training thread may wait (ckptio:
    its wait() removes optimizer hooks) and the engine's own total_s is the time. ``report``
    runs on the training thread once durable: what the engine says about itself; it raises the
    save's error."""

    durable: Callable[[], object] | None
    report: Callable[[], dict[str, Any]] = _nothing


class Saver(Protocol):
    def start(self, state: Any, path: Path) -> Pending: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainEngine:
    name: str
    make: Callable[[Context], Saver] | None  # None: never checkpoints (the baseline)
    load: LoadFn | None
    is_async: bool  # the training loop may run on while the save is still in progress
    note: str
    modules: tuple[str, ...] = ()  # imported before anything is timed

    def prepare(self) -> None:
        for module in self.modules:
            importlib.import_module(module)


# ---------------------------------------------------------------- torch.save (blocking)


class BlockingSaver:
    """torch.save + fsync + os.sync(), durable when start returns (engines.py's save)."""

    def __init__(self, ctx: Context) -> None:
        self.save = engines.ENGINES["torch_save"].save

    def start(self, state: Any, path: Path) -> Pending:
        self.save(state, path)
        return Pending(durable=_nothing)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- DCP async_save


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DcpAsyncSaver:
    """dcp.async_save on a 1-rank gloo group: the process executor reads the group's rank and
    world size and re-creates the group in its helper process from MASTER_ADDR/MASTER_PORT."""

    def __init__(self, ctx: Context, process: bool, async_stager: bool = False,
                 staging: Any = None) -> None:
        """``staging``: StagingOptions for a DefaultStager (gpu_engines.dcp_best); without it,
        ``async_stager`` stages on CPU without pinned or shared memory."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        port = free_port()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.optimizer = ctx.optimizer
        self.hooks: list[Any] = []
        self.stager: Any = None
        if async_stager or staging is not None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # CPU: no pinned or shared memory; staged on DCP's own thread while training goes on
            self.stager = DefaultStager(staging or StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=False))

    def start(self, state: Any, path: Path) -> Pending:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(path), thread_count=DCP_THREADS, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            response = dcp.async_save(state, storage_writer=writer,
                                      async_checkpointer_type=self.kind,
                                      async_stager=self.stager)
        # an AsyncSaveResponse only with an asynchronous stager; the default one is synchronous
        future = getattr(response, "upload_completion", response)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # the state may change only once staged: the next step waits
            self._wait_before_step(staged)
        return Pending(durable=future.result)

    def _wait_before_step(self, staged: Any) -> None:
        """An optimizer pre-hook waits for DCP's staging (as ckptio_lazy's does for its capture);
        removed by the next save (torch iterates its hooks during step(): not from inside one)."""
        for old in self.hooks:
            old.remove()
        self.hooks = [self.optimizer.register_step_pre_hook(lambda *_args: staged.result())]

    def close(self) -> None:
        import torch.distributed as dist

        for hook in self.hooks:
            hook.remove()
        if self.stager is not None:
            self.stager.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- TorchSnapshot async_take


class SnapshotSaver:
    """Snapshot.async_take clones CPU tensors before returning; the rest runs in its thread.
    It never fsyncs, so durable() adds os.sync()."""

    def __init__(self, ctx: Context) -> None:
        pass

    def start(self, state: Any, path: Path) -> Pending:
        from torchsnapshot import Snapshot

        pending = Snapshot.async_take(path=str(path),
                                      app_state={"state": engines.DictStateful(state)})

        def durable() -> None:
            pending.wait()
            os.sync()

        return Pending(durable=durable)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- ckptio async_save


class CkptioSaver:
    """One Checkpointer for the run with default options (``--pool-gb`` sets pool_bytes and
    host_budget_bytes 0 instead: a fixed pool); its pool and I/O threads are made at setup
    (Checkpointer.prepare, as a training job would at startup). The first async save streams
    through the default 256 MiB pool and then grows it to hold the state (host_budget_bytes),
    so later saves return at copy speed; ``staging_bytes`` reports what it held."""

    def __init__(self, ctx: Context, lazy: bool) -> None:
        ckptio = importlib.import_module("ckptio")
        # No tuned profile: runs compare engines, not what `ckptio tune` stored on this machine.
        fixed = {"pool_bytes": ctx.pool_bytes, "host_budget_bytes": 0} if ctx.pool_bytes else {}
        self.checkpointer = ckptio.Checkpointer(ckptio.Options.from_env(use_profile=False, **fixed))
        self.checkpointer.prepare()
        self.lazy = lazy
        self.optimizers = [ctx.optimizer] if lazy else []
        self.after_step: list[Any] = []  # lazy: modules changed only after the step (gpu_phases)
        self.staging_bytes = 0

    def start(self, state: Any, path: Path) -> Pending:
        handle = self.checkpointer.async_save(state, str(path), lazy=self.lazy,
                                              optimizers=self.optimizers,
                                              after_step=self.after_step)

        def report() -> dict[str, Any]:
            result = handle.wait()  # on the training thread, as ckptio requires
            self.staging_bytes = self.checkpointer.staging_nbytes
            return {f: getattr(result, f) for f in CKPTIO_FIELDS if hasattr(result, f)}

        return Pending(durable=None, report=report)

    def close(self) -> None:
        self.checkpointer.close()


# ---------------------------------------------------------------- floors (no checkpoint format)


class FloorSaver:
    """What any durable asynchronous checkpoint of the state costs the loop, at least, on this
    machine: ``copy`` the snapshot's one memcpy of every tensor (ctypes.memmove, which releases
    the GIL and starts no intra-op threads) on a helper thread; ``write`` the state's byte count
    written from one pre-faulted buffer with O_DIRECT (16 MiB writes, 4 in flight: ckptio's
    defaults) and fsynced, on helper threads. No checksum, no format, nothing loadable: the
    floors say what the storage and the copy alone take from the training loop."""

    CHUNK = 16 << 20

    def __init__(self, ctx: Context, copy: bool, write: bool) -> None:
        self.copy, self.write = copy, write
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="floor")
        self.writers = ThreadPoolExecutor(4, thread_name_prefix="floor-io")
        # made and pre-faulted now, as a job makes its staging at startup: the state is the
        # parameters and AdamW's two moments (plus steps and scalars: the margin)
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        self.snapshot = self._buffer(3 * sum(p.numel() * p.element_size() for p in params)
                                     + self.CHUNK)

    def _buffer(self, nbytes: int) -> mmap.mmap:
        buffer = mmap.mmap(-1, -(-nbytes // self.CHUNK) * self.CHUNK)
        buffer.write(bytes(len(buffer)))  # pre-faulted
        return buffer

    def start(self, state: Any, path: Path) -> Pending:
        from ckptio.tuning.state import tensor_leaves

        unique = {(t.data_ptr(), t.numel()): t for _key, t in tensor_leaves(state)}  # tied once
        sources = [t.detach() for t in unique.values()]
        nbytes = sum(t.numel() * t.element_size() for t in sources)
        if len(self.snapshot) < nbytes:
            self.snapshot = self._buffer(nbytes)
        job = self.helper.submit(self._persist, sources, nbytes, path)
        return Pending(durable=job.result)

    def _persist(self, sources: list[torch.Tensor], nbytes: int, path: Path) -> None:
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.snapshot))
        if self.copy:
            offset = 0
            for t in sources:
                n = t.numel() * t.element_size()
                ctypes.memmove(base + offset, t.data_ptr(), n)
                offset += n
        if self.write:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                view = memoryview(self.snapshot)
                total = -(-nbytes // 4096) * 4096
                writes = [self.writers.submit(os.pwrite, fd, view[o:min(o + self.CHUNK, total)], o)
                          for o in range(0, total, self.CHUNK)]
                for w in writes:
                    w.result()
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        self.helper.shutdown(wait=True)
        self.writers.shutdown(wait=True)


def pool_bytes_for(pool_gb: float | None) -> int:
    """--pool-gb as whole staging buffers, else 0 (ckptio's defaults)."""
    if not pool_gb:
        return 0
    ckptio = importlib.import_module("ckptio")
    buffer = int(ckptio.Options().buffer_bytes)
    return max(2, math.ceil(int(pool_gb * 1e9) / buffer)) * buffer


# ---------------------------------------------------------------- registry

_LOADERS = {name: engines.ENGINES[key].load for name, key in (
    ("torch_save", "torch_save"), ("dcp", "dcp_t1"), ("torchsnapshot", "torchsnapshot"),
    ("ckptio", "ckptio"))}
_DCP = ("torch.distributed.checkpoint",)

ENGINES: dict[str, TrainEngine] = {
    "none": TrainEngine("none", None, None, False, "no checkpoints: the baseline step time"),
    "torch_save": TrainEngine("torch_save", BlockingSaver, _LOADERS["torch_save"], False,
                              "torch.save + fsync + os.sync(), blocking"),
    "dcp_async_thread": TrainEngine(
        "dcp_async_thread", lambda c: DcpAsyncSaver(c, process=False), _LOADERS["dcp"], True,
        f"dcp.async_save, thread executor, default (synchronous) stager, FileSystemWriter("
        f"thread_count={DCP_THREADS}, sync_files=True), 1-rank gloo group", _DCP),
    "dcp_async_process": TrainEngine(
        "dcp_async_process", lambda c: DcpAsyncSaver(c, process=True), _LOADERS["dcp"], True,
        "as dcp_async_thread with AsyncCheckpointerType.PROCESS (helper process started by the "
        "first save; its memory is in the helper RSS column)", _DCP),
    "dcp_async_stager": TrainEngine(
        "dcp_async_stager", lambda c: DcpAsyncSaver(c, process=False, async_stager=True),
        _LOADERS["dcp"], True,
        "as dcp_async_thread with async_stager=DefaultStager(StagingOptions(use_async_staging="
        "True), no pinned or shared memory on CPU): async_save returns before staging; the next "
        "optimizer step waits for staging_completion (a pre-hook)", _DCP),
    "torchsnapshot": TrainEngine("torchsnapshot", SnapshotSaver, _LOADERS["torchsnapshot"], True,
                                 "Snapshot.async_take; durable = wait() + os.sync()",
                                 ("torchsnapshot",)),
    "ckptio_eager": TrainEngine("ckptio_eager", lambda c: CkptioSaver(c, lazy=False),
                                _LOADERS["ckptio"], True,
                                "Checkpointer().async_save(state, path), default options; "
                                "wait() before the next save; T_persist = the result's total_s",
                                ("ckptio",)),
    "ckptio_lazy": TrainEngine("ckptio_lazy", lambda c: CkptioSaver(c, lazy=True),
                               _LOADERS["ckptio"], True,
                               "as ckptio_eager with lazy=True, optimizers=[opt] (capture "
                               "overlaps forward/backward; the optimizer step waits for it)",
                               ("ckptio",)),
    "floor_copy": TrainEngine("floor_copy", lambda c: FloorSaver(c, copy=True, write=False), None,
                              True, "the floor of a snapshot: one memcpy of every tensor into a "
                              "pre-faulted buffer on a helper thread; nothing written"),
    "floor_write": TrainEngine("floor_write", lambda c: FloorSaver(c, copy=False, write=True), None,
                               True, "the floor of the storage: the state's byte count written "
                               "O_DIRECT from a pre-faulted buffer and fsynced on helper threads "
                               "(16 MiB writes, 4 in flight); no copy, no checksum"),
    "floor_copy_write": TrainEngine("floor_copy_write",
                                    lambda c: FloorSaver(c, copy=True, write=True), None, True,
                                    "floor_copy then floor_write: the least a durable async "
                                    "checkpoint does, with no format and no checksums"),
}


def unavailable_reason(name: str) -> str | None:
    """None when ``name`` can run here, else why not."""
    if name not in ENGINES:
        return f"unknown engine {name!r}; known: {', '.join(ENGINES)}"
    if name.startswith("dcp") and not _gloo_available():
        return "torch.distributed with gloo is not available"
    if name == "torchsnapshot" and importlib.util.find_spec("torchsnapshot") is None:
        return "torchsnapshot is not installed"
    if name.startswith("ckptio"):
        return _ckptio_async_unavailable()
    return None


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _ckptio_async_unavailable() -> str | None:
    if (why := engines.unavailable_reason("ckptio")) is not None:
        return why
    ckptio = importlib.import_module("ckptio")
    if not callable(getattr(ckptio, "async_save", None)):
        return "ckptio has no async_save yet"
    if not callable(getattr(ckptio.Checkpointer, "async_save", None)):
        return "ckptio.Checkpointer has no async_save yet"
    return None
