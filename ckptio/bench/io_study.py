"""The checkpoint I/O study (after Gossman, Maurya and Nicolae 2025) on the user's own storage.

Owns: the cells of the study (engine x queue depth x mode x write size x alignment x layout x
workload), the plan of files and requests each cell writes, the three engines (posix1: one thread
of os.pwrite/os.preadv; posix_pool and uring: ckptio's IO backends), one timed durable write and
one timed cold read per cell, the raw ceiling of the same run (ceiling.py) and the command line.
Does not own: summaries, tables and plots (io_report.py), the ceiling itself (ceiling.py), the
GPT shapes (state.py), or anything ckptio.save does beyond raw I/O (no staging copies here).

Protocol: one process; the source and sink buffers are mmap'd once, pre-faulted, and reused by
every request (this VM hands freed memory back to the host, so allocating inside the clock would
time the allocator). The write clock runs from creating the first file to the last fsync (both
modes: O_DIRECT writes into preallocated extents still need the metadata commit), with create +
fallocate and fsync shares reported apart. Reads are cold: page cache dropped first. Cells run
in a shuffled order per repetition; GB/s is payload bytes / seconds, GB = 1e9.

    ckptio bench io /mnt/ckpt --quick
    python -m ckptio.bench.io_study /mnt/ckpt --reps 3 --out docs/results/io_full
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import mmap
import os
import random
import shutil
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import io as ckpt_io
from ..errors import CkptError
from ..io.base import FileHandle, IOBackend
from . import ceiling

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK = 4096
ENGINES = ("posix1", "posix_pool", "uring")
MODES = ("direct", "buffered")
SECTIONS = ("sweep", "align", "layout", "mix", "extend")
Run = dict[str, Any]


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


@dataclass(frozen=True)
class StudyConfig:
    total_nbytes: int
    sizes: tuple[int, ...]
    pool_depths: tuple[int, ...]
    uring_depths: tuple[int, ...]
    modes: tuple[str, ...]
    sections: tuple[str, ...]
    align_sizes: tuple[int, ...]
    layout_sizes: tuple[int, ...]
    extend_sizes: tuple[int, ...]
    mix_chunk_nbytes: int
    reps: int
    idle_s: float
    seed: int = 0

    @property
    def max_req_nbytes(self) -> int:
        return max((*self.sizes, *self.align_sizes, *self.layout_sizes, *self.extend_sizes,
                    self.mix_chunk_nbytes))


# ---------------------------------------------------------------- workloads and plans


def round_up(n: int, alignment: int = BLOCK) -> int:
    return (n + alignment - 1) // alignment * alignment


def equal_sizes(total_nbytes: int, nbytes: int) -> list[int]:
    return [nbytes] * max(1, total_nbytes // nbytes)


def gpt_param_numels(d: int, layers: int, vocab: int, context: int) -> list[int]:
    """Parameter sizes of state.GPT in state-dict order (lm_head tied, so counted once)."""
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [vocab * d, context * d, *block * layers, d, d]


def gpt_sizes(total_nbytes: int) -> list[int]:
    """Tensor sizes of state.build_state at about ``total_nbytes``, without building it: fp32
    weights, then AdamW's exp_avg, exp_avg_sq and 4-byte step per parameter, then the RNG."""
    from . import state  # imports torch (2 s): only when the mix is studied

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
    pad = round_up if cell.mode == "direct" else (lambda n: n)
    if cell.layout == "file_per_tensor":
        files = [FilePlan(f"t{i:06d}.bin", base + pad(n), tuple(_split(base, pad(n), chunk, base)))
                 for i, n in enumerate(sizes)]
        return Plan(tuple(files), sum(sizes), sum(pad(n) for n in sizes))
    reqs, cursor = [], base
    for n in sizes:
        start = round_up(cursor) if cell.aligned else cursor
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

    def open_read(self, path: str) -> FileHandle:
        return FileHandle(path, os.open(path, os.O_RDONLY | os.O_CLOEXEC | self._flag()), self.direct)

    def _flag(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        return _done(lambda: _transfer(lambda v, o: os.pwrite(fh.fd, v, o), offset, data))

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        return _done(lambda: _transfer(lambda v, o: os.preadv(fh.fd, [v], o), offset, into))

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        try:
            if sync:
                os.fsync(fh.fd)
        finally:
            os.close(fh.fd)

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
    name = {"posix_pool": "posix", "uring": "uring"}[engine]
    return ckpt_io.create(name, depth=depth, direct_io="on" if mode == "direct" else "off")


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


# ---------------------------------------------------------------- the study


def _faulted(nbytes: int, pattern: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf.write(pattern * (nbytes // len(pattern)))  # every page touched before any clock starts
    return buf


class Study:
    """The scratch directory, the two reused buffers and the backends of one run."""

    def __init__(self, directory: Path, config: StudyConfig) -> None:
        self.directory, self.config = directory, config
        self.root = directory / f".ckptio-io-study-{os.getpid()}"
        self._created = not directory.exists()
        self._backends: dict[tuple[str, int, str], IOBackend] = {}
        self.fixed_buffers: dict[str, bool] = {}  # backend label -> buffers registered with it
        self._plans: dict[Cell, Plan] = {}
        self._gpt: list[int] | None = None

    def __enter__(self) -> Study:
        self.root.mkdir(parents=True)
        half = self.config.max_req_nbytes + BLOCK  # room for the one-byte shift of unaligned cells
        # One mapping for both, so a backend can register it whole as fixed buffers (uring).
        self._mem = _faulted(2 * half, bytes(range(256)))
        self.buffers = memoryview(self._mem)
        self.src, self.sink = self.buffers[:half], self.buffers[half:]
        return self

    def __exit__(self, *exc: object) -> None:
        for backend in self._backends.values():
            backend.shutdown()
        shutil.rmtree(self.directory if self._created else self.root, ignore_errors=True)
        for view in (self.src, self.sink, self.buffers):
            view.release()
        with contextlib.suppress(BufferError):  # a slice still referenced (a failed request's
            self._mem.close()  # traceback): the garbage collector frees it

    def sizes(self, workload: str, write_nbytes: int) -> list[int]:
        if workload == "equal":
            return equal_sizes(self.config.total_nbytes, write_nbytes)
        if self._gpt is None:
            self._gpt = gpt_sizes(self.config.total_nbytes)
        return self._gpt

    def plan(self, cell: Cell) -> Plan:
        if cell not in self._plans:
            self._plans[cell] = build_plan(self.sizes(cell.workload, cell.write_nbytes), cell)
        return self._plans[cell]

    def backend(self, cell: Cell) -> IOBackend:
        key = (cell.engine, cell.depth, cell.mode)
        if key not in self._backends:
            backend = self._backends[key] = make_backend(*key)
            register = getattr(backend, "register_buffers", None)  # as ckptio registers its pool
            if register is not None:
                self.fixed_buffers[f"{cell.engine} d{cell.depth} {cell.mode}"] = register(self.buffers)
        return self._backends[key]

    def measure(self, cell: Cell, rep: int) -> Run:
        plan, work = self.plan(cell), self.root / "cell"
        run: Run = {**asdict(cell), "rep": rep, "payload_nbytes": plan.payload_nbytes,
                    "io_nbytes": plan.io_nbytes, "files": len(plan.files),
                    "requests": sum(len(f.reqs) for f in plan.files)}
        work.mkdir()
        try:
            w, r, drop = self._write_read(cell, plan, work)
        except (OSError, CkptError) as exc:
            return {**run, "error": str(exc) or type(exc).__name__}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        gb = plan.payload_nbytes / 1e9
        return {**run, "write_s": w.seconds, "open_s": w.open_s, "sync_s": w.sync_s,
                "read_s": r.seconds, "write_gbps": gb / w.seconds, "read_gbps": gb / r.seconds,
                "cache_drop": drop}

    def _write_read(self, cell: Cell, plan: Plan, work: Path) -> tuple[PhaseTimes, PhaseTimes, str]:
        backend = self.backend(cell)
        os.sync()  # commit the journal and the discards of the previous cell's files, untimed
        time.sleep(self.config.idle_s)
        w = run_phase(backend, work, plan, self.src, cell.depth, write=True)
        drop = ceiling.drop_page_cache([work])
        time.sleep(self.config.idle_s)
        r = run_phase(backend, work, plan, self.sink, cell.depth, write=False)
        return w, r, drop

    def ceiling(self, rep: int) -> Run:
        """ceiling.py's O_DIRECT write and cold read of the cell byte count, best geometry."""
        path, nbytes, tries = self.root / "ceiling.bin", self.config.total_nbytes, list[Run]()
        for chunk, threads in ceiling.GEOMETRIES:
            chunk = min(chunk, round_up(nbytes))
            try:
                os.sync()
                time.sleep(self.config.idle_s)
                w = ceiling.write_ceiling(path, nbytes, chunk, threads)
                r = ceiling.read_ceiling(path, self.config.idle_s, chunk, threads)
            except OSError as exc:  # e.g. tmpfs refuses O_DIRECT: the study runs, without ratios
                return {"rep": rep, "nbytes": nbytes, "error": str(exc)}
            finally:
                path.unlink(missing_ok=True)
            tries.append({"chunk": chunk, "threads": threads, "write_s": float(w["seconds"]),
                          "read_s": float(r["seconds"]), "cache_drop": r["cache_drop"]})
        gb = nbytes / 1e9
        return {"rep": rep, "nbytes": nbytes, "geometries": tries,
                "write_gbps": max(gb / t["write_s"] for t in tries),
                "read_gbps": max(gb / t["read_s"] for t in tries)}


def reference_depth(depths: Sequence[int], preferred: int) -> int:
    return preferred if preferred in depths else max(depths)


def engine_depths(config: StudyConfig, engines: Sequence[str]) -> list[tuple[str, int]]:
    depths = {"posix1": (1,), "posix_pool": config.pool_depths, "uring": config.uring_depths}
    return [(e, d) for e in engines for d in depths[e]]


def make_cells(config: StudyConfig, engines: Sequence[str]) -> list[Cell]:
    """Every cell of the chosen sections, each once (sections share cells: the layout section's
    aggregated cells are sweep cells)."""
    refs = {"posix1": 1, "posix_pool": reference_depth(config.pool_depths, 4),
            "uring": reference_depth(config.uring_depths, 16)}
    ref = [(e, refs[e]) for e in engines]
    cells: list[Cell] = []
    want = set(config.sections)
    for mode in config.modes:
        if "sweep" in want:
            cells += [Cell("equal", "aggregated", e, d, mode, n)
                      for e, d in engine_depths(config, engines) for n in config.sizes]
        if "align" in want and mode == "buffered":  # O_DIRECT refuses misalignment: see probe
            cells += [Cell("equal", "aggregated", e, d, mode, n, aligned=a)
                      for e, d in ref for n in config.align_sizes for a in (True, False)]
        if "layout" in want:
            cells += [Cell("equal", lay, e, d, mode, n) for e, d in ref
                      for n in config.layout_sizes for lay in ("aggregated", "file_per_tensor")]
        if "mix" in want:
            big = config.max_req_nbytes  # one request per tensor, the biggest ones split at this cap
            cells += [Cell("gpt", lay, e, d, mode, config.mix_chunk_nbytes if lay == "coalesced" else big)
                      for e, d in ref for lay in ("file_per_tensor", "aggregated", "coalesced")]
        if "extend" in want:
            cells += [Cell("equal", "aggregated", e, d, mode, n, prealloc=p)
                      for e, d in ref for n in config.extend_sizes for p in (True, False)]
    return list(dict.fromkeys(cells))


def run_study(study: Study, cells: Sequence[Cell], with_ceiling: bool = True) -> tuple[list[Run], list[Run]]:
    """Every cell once per repetition in a fresh shuffled order, the ceiling first each time;
    a progress line on stderr after each."""
    from .io_report import progress

    runs: list[Run] = []
    ceilings: list[Run] = []
    total = study.config.reps * len(cells)
    for rep in range(study.config.reps):
        if with_ceiling:
            ceilings.append(study.ceiling(rep))
            print(progress(ceilings[-1], 0, total), file=sys.stderr, flush=True)
        order = list(cells)
        random.Random(study.config.seed + rep).shuffle(order)
        for cell in order:
            runs.append(study.measure(cell, rep))
            print(progress(runs[-1], len(runs), total), file=sys.stderr, flush=True)
    return runs, ceilings


# ---------------------------------------------------------------- command line

QUICK = {"total": "64M", "sizes": "64K,1M,16M", "pool_depths": "4", "uring_depths": "1,16",
         "reps": 1, "idle": 0.0, "align_sizes": "1M", "layout_sizes": "1M", "extend_sizes": "",
         "sections": "sweep,align,layout,mix"}
FULL = {"total": "1G", "sizes": "64K,256K,1M,4M,16M,64M", "pool_depths": "1,4,16",
        "uring_depths": "1,4,16,32", "reps": 3, "idle": 1.0, "align_sizes": "64K,1M,16M",
        "layout_sizes": "1M,16M", "extend_sizes": "1M,16M", "sections": ",".join(SECTIONS)}


def parse_nbytes(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_list(text: str, parse: Any = int) -> tuple[Any, ...]:
    return tuple(parse(s) for s in text.split(",") if s.strip())


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ckptio bench io", description=(
        "Checkpoint I/O study: engines x queue depth x O_DIRECT/buffered x write size x alignment "
        "x file-per-tensor/aggregated, durable writes and cold reads, beside the raw ceiling."))
    p.add_argument("dir", type=Path, help="directory on the storage under test (scratch is deleted)")
    p.add_argument("--quick", action="store_true", help="a smaller study, under a minute")
    p.add_argument("--total", help="bytes per cell (default 1G; quick 64M)")
    p.add_argument("--sizes", help="write sizes of the sweep (default 64K,256K,1M,4M,16M,64M)")
    p.add_argument("--pool-depths", help="posix_pool thread counts (default 1,4,16)")
    p.add_argument("--uring-depths", help="uring queue depths (default 1,4,16,32)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list (default: all)")
    p.add_argument("--modes", default=",".join(MODES), help="direct,buffered")
    p.add_argument("--sections", help=f"comma list of {','.join(SECTIONS)}")
    p.add_argument("--align-sizes", help="write sizes of the alignment cells")
    p.add_argument("--layout-sizes", help="write sizes of the file-per-tensor cells")
    p.add_argument("--extend-sizes", help="write sizes of the extending-write cells")
    p.add_argument("--mix-chunk", default="16M", help="request size of the coalesced mix (16M)")
    p.add_argument("--reps", type=int, help="repetitions (default 3; quick 1)")
    p.add_argument("--idle", type=float, help="idle seconds before each timed phase (1; quick 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the cell order")
    p.add_argument("--out", type=Path, default=Path("io_study"),
                   help="prefix of the outputs: PREFIX.json, PREFIX.md, PREFIX_*.png")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def config_from(args: argparse.Namespace) -> StudyConfig:
    return StudyConfig(
        total_nbytes=parse_nbytes(args.total), sizes=parse_list(args.sizes, parse_nbytes),
        pool_depths=parse_list(args.pool_depths), uring_depths=parse_list(args.uring_depths),
        modes=parse_list(args.modes, str.strip), sections=parse_list(args.sections, str.strip),
        align_sizes=parse_list(args.align_sizes, parse_nbytes),
        layout_sizes=parse_list(args.layout_sizes, parse_nbytes),
        extend_sizes=parse_list(args.extend_sizes, parse_nbytes),
        mix_chunk_nbytes=parse_nbytes(args.mix_chunk), reps=args.reps, idle_s=args.idle,
        seed=args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    from . import io_report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = config_from(args)
    t0 = time.perf_counter()
    with Study(args.dir, config) as study:
        engines, unavailable = [], {}
        for engine in parse_list(args.engines, str.strip):
            if (why := engine_unavailable(engine, study.root)) is None:
                engines.append(engine)
            else:
                unavailable[engine] = why
                print(f"skipping {engine}: {why}", file=sys.stderr)
        cells = make_cells(config, engines)
        print(f"{len(cells)} cells x {config.reps} reps, {config.total_nbytes / MiB:.0f} MiB each",
              file=sys.stderr)
        meta = io_report.machine(args.dir, probe_unaligned_direct(study.root))
        if any(c.workload == "gpt" for c in cells):
            meta["gpt_mix"] = io_report.mix_stats(study.sizes("gpt", 0))
        runs, ceilings = run_study(study, cells)
    meta.update(argv=argv, config=asdict(config), engines=engines, unavailable=unavailable,
                fixed_buffers=study.fixed_buffers, seconds=time.perf_counter() - t0)
    io_report.write_all(runs, ceilings, meta, args.out)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
