"""The cells of the checkpoint I/O study and the timed I/O each one does.

Owns: the description of one cell (Cell: engine x queue depth x mode x write size x alignment x
layout x workload), the workloads (equal sizes, the GPT + AdamW tensor-size mix), the plan of
files and requests a cell writes, the three engines (posix1: one thread of os.pwrite/os.preadv;
posix_pool and uring: ckptio's IO backends), the probes of what this storage accepts, and one
timed phase (durable write or read) of a plan with at most N requests in flight.
Does not own: the study's configuration, scratch directory, buffers, cell list, repetitions
or command line (io_study.py), the ceiling (ceiling.py), the GPT shapes (state.py), or
summaries, tables and plots (io_report.py, io_plots.py).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptio import io as ckpt_io
from ckptio.alignment import BLOCK, align_up
from ckptio.errors import CkptError
from ckptio.io.backend_contract import FileHandle, IOBackend

__all__ = ["BACKEND_OF", "ENGINES", "MODES", "Cell", "PhaseTimes", "Plan", "Run", "build_plan",
           "engine_unavailable", "equal_sizes", "gpt_sizes", "make_backend",
           "probe_unaligned_direct", "run_phase"]

Run = dict[str, Any]
ENGINES = ("posix1", "posix_pool", "uring")  # the study's engines, in the order tables list them
MODES = ("direct", "buffered")  # Cell.mode
BACKEND_OF = {"posix_pool": "posix", "uring": "uring"}  # engine -> ckptio io_backend name



@dataclass(frozen=True)
class Cell:
    """One measured configuration. ``write_nbytes`` is the size of every request (equal workload,
    coalesced layout) or the cap on one request (gpt tensors written one request each)."""

    workload: str  # "equal" (same-size tensors) | "gpt" (GPT + AdamW tensor-size mix)
    layout: str  # "aggregated" (one file, one request per tensor) | "coalesced" | "file_per_tensor"
    engine: str
    depth: int
    mode: str  # "direct" (O_DIRECT) | "buffered" (page cache, fsync inside the clock)
    write_nbytes: int
    aligned: bool = True  # False: buffer address and file offsets shifted by one byte
    prealloc: bool = True  # False: extending writes into an empty file


@dataclass(frozen=True)
class Req:
    offset: int
    nbytes: int
    buf_offset: int


@dataclass(frozen=True)
class FilePlan:
    name: str
    nbytes: int
    reqs: tuple[Req, ...]


@dataclass(frozen=True)
class Plan:
    files: tuple[FilePlan, ...]
    payload_nbytes: int  # tensor bytes: what GB/s counts
    io_nbytes: int  # bytes moved, O_DIRECT padding included


# ---------------------------------------------------------------- workloads and plans


def equal_sizes(total_nbytes: int, nbytes: int) -> list[int]:
    return [nbytes] * max(1, total_nbytes // nbytes)


def gpt_param_numels(d: int, layers: int, vocab: int, context: int) -> list[int]:
    """Parameter sizes of state.GPT in state-dict order (lm_head tied, so counted once)."""
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [vocab * d, context * d, *block * layers, d, d]


def gpt_sizes(total_nbytes: int) -> list[int]:
    """Tensor sizes of state.build_state at about ``total_nbytes``, without building it: fp32
    weights, then AdamW's exp_avg, exp_avg_sq and 4-byte step per parameter, then the RNG."""
    from ckptio.tuning import state  # imports torch (slow): only when the mix is studied

    cfg = state.gpt_config(total_nbytes / state.GB)
    params = [4 * n for n in gpt_param_numels(cfg.d_model, cfg.n_layers, cfg.vocab, cfg.context)]
    optim = [n for p in params for n in (p, p, 4)]
    return [*params, *optim, state.rng_nbytes()]


def _split(offset: int, nbytes: int, chunk: int, buf_offset: int) -> list[Req]:
    return [Req(offset + k, min(chunk, nbytes - k), buf_offset) for k in range(0, nbytes, chunk)]


def build_plan(sizes: Sequence[int], cell: Cell) -> Plan:
    """Files and requests of ``cell``. O_DIRECT pads every tensor to 4 KiB; aggregated tensors
    start at 4 KiB-aligned offsets (unaligned cells: packed after a one-byte header)."""
    base, chunk = 0 if cell.aligned else 1, cell.write_nbytes
    pad = align_up if cell.mode == "direct" else (lambda n: n)
    if cell.layout == "file_per_tensor":
        files = [FilePlan(f"t{i:06d}.bin", base + pad(n), tuple(_split(base, pad(n), chunk, base)))
                 for i, n in enumerate(sizes)]
        return Plan(tuple(files), sum(sizes), sum(pad(n) for n in sizes))
    reqs, cursor = [], base
    for n in sizes:
        start = align_up(cursor) if cell.aligned else cursor
        reqs += _split(start, pad(n), chunk, base)
        cursor = start + pad(n)
    if cell.layout == "coalesced":  # the same bytes in few large requests, as ckptio stages them
        reqs = _split(0, pad(cursor), chunk, 0)
    return Plan((FilePlan("aggregated.bin", cursor, tuple(reqs)),), sum(sizes),
                sum(r.nbytes for r in reqs))


# ---------------------------------------------------------------- engines


class SyncBackend:
    """posix1: os.pwrite/os.preadv in the calling thread; its futures are done when returned."""

    name = "posix1"

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | self._flag())
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            raise
        return FileHandle(path, fd, self.direct)

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        direct = self.direct and not cached
        flag = os.O_DIRECT if direct else 0
        return FileHandle(path, os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag), direct)

    def _flag(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        return _done(lambda: _transfer(lambda v, o: os.pwrite(fh.token, v, o), offset, data))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        return _done(lambda: _transfer(lambda v, o: os.preadv(fh.token, [v], o), offset, into))

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        try:
            if sync:
                os.fsync(fh.token)
        finally:
            os.close(fh.token)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """No fixed buffers here: every request maps its own."""
        return False

    def shutdown(self) -> None:
        pass


def _transfer(fn: Any, offset: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        n = fn(view[done:], offset + done)
        if n <= 0:
            break  # end of file on a read; the caller compares against the request
        done += n
    return done


def _done(fn: Any) -> Future[int]:
    fut: Future[int] = Future()
    try:
        fut.set_result(fn())
    except OSError as exc:
        fut.set_exception(exc)
    return fut


def make_backend(engine: str, depth: int, mode: str) -> IOBackend:
    if engine == "posix1":
        return SyncBackend(mode == "direct")
    return ckpt_io.create(BACKEND_OF[engine], depth=depth,
                          direct_io="on" if mode == "direct" else "off")


def engine_unavailable(engine: str, directory: Path) -> str | None:
    """Why ``engine`` cannot run here (None if it can): one 4 KiB write and read, buffered."""
    path = directory / f"probe-{engine}.bin"
    try:
        backend = make_backend(engine, 1, "buffered")
        try:
            buf = mmap.mmap(-1, BLOCK)
            fh = backend.open_write(str(path), BLOCK)
            backend.submit_write(fh, 0, memoryview(buf)).result()
            backend.close(fh, sync=False)
        finally:
            backend.shutdown()
    except (CkptError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        path.unlink(missing_ok=True)
    return None


def probe_unaligned_direct(directory: Path) -> str:
    """What this filesystem answers to an O_DIRECT write from a misaligned buffer and offset."""
    path = directory / "probe-unaligned.bin"
    buf = mmap.mmap(-1, 2 * BLOCK)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, memoryview(buf)[1 : 1 + BLOCK], 1)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"refused ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    finally:
        path.unlink(missing_ok=True)
    return "accepted"


# ---------------------------------------------------------------- timed phases


@dataclass
class PhaseTimes:
    seconds: float = 0.0
    open_s: float = 0.0  # create + fallocate (writes) or open (reads)
    sync_s: float = 0.0  # fsync + close


@dataclass
class _Open:
    fh: FileHandle
    futures: list[Future[int]] = field(default_factory=list)


def run_phase(backend: IOBackend, root: Path, plan: Plan, buf: memoryview, depth: int,
              write: bool) -> PhaseTimes:
    """Every request of ``plan`` with at most ``depth`` in flight (oldest awaited first); each
    file is closed (fsynced when writing) as soon as its requests are done."""
    times, window, files = PhaseTimes(), deque[tuple[Future[int], int]](), deque[_Open]()
    t0 = time.perf_counter()
    try:
        for f in plan.files:
            ta = time.perf_counter()
            path = str(root / f.name)
            fh = backend.open_write(path, f.nbytes) if write else backend.open_read(path)
            times.open_s += time.perf_counter() - ta
            files.append(_Open(fh))
            for r in f.reqs:
                if len(window) >= depth:
                    _check(*window.popleft())
                view = buf[r.buf_offset : r.buf_offset + r.nbytes]
                submit = backend.submit_write if write else backend.submit_read
                window.append((submit(fh, r.offset, view), r.nbytes))
                files[-1].futures.append(window[-1][0])
            _close_done(backend, files, times, write, everything=False)
        while window:
            _check(*window.popleft())
        _close_done(backend, files, times, write, everything=True)
    except BaseException:
        _abandon(backend, window, files)
        raise
    times.seconds = time.perf_counter() - t0
    return times


def _check(fut: Future[int], nbytes: int) -> None:
    got = fut.result()
    if got != nbytes:
        raise OSError(errno.EIO, f"short transfer: {got} of {nbytes} bytes")


def _close_done(backend: IOBackend, files: deque[_Open], times: PhaseTimes, write: bool,
                everything: bool) -> None:
    while files and (everything or all(f.done() for f in files[0].futures)):
        ta = time.perf_counter()
        backend.close(files.popleft().fh, sync=write)
        times.sync_s += time.perf_counter() - ta


def _abandon(backend: IOBackend, window: deque[tuple[Future[int], int]], files: deque[_Open]) -> None:
    """After a failure: let requests in flight finish (they use the fds), then close unsynced."""
    wait([f for f, _ in window])
    for f in files:
        with contextlib.suppress(OSError, CkptError):  # the original error is the one to raise
            backend.close(f.fh, sync=False)
