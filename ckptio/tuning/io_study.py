"""The checkpoint I/O study (after Gossman, Maurya and Nicolae 2025) on the user's own storage.

Owns: the study's configuration, the list of cells of each section (sweep, align, layout, mix,
extend), the scratch directory, the two reused buffers and the backends of one run, one timed
durable write and one timed cold read per cell and repetition, the raw ceiling of the same run
(ceiling.py) and the command line.
Does not own: what a cell is, its plan of files and requests, the engines and the timed I/O
itself (io_cells.py), summaries and tables (io_report.py) and plots (io_plots.py), the ceiling
itself (ceiling.py), the GPT shapes (state.py), or anything ckptio.save does beyond raw I/O (no
staging copies here).

Protocol: one process; the source and sink buffers are mmap'd once, pre-faulted, and reused by
every request (this VM hands freed memory back to the host, so allocating inside the clock would
time the allocator). The write clock runs from creating the first file to the last fsync (both
modes: O_DIRECT writes into preallocated extents still need the metadata commit), with create +
fallocate and fsync shares reported apart. Reads are cold: page cache dropped first. Cells run
in a shuffled order per repetition; GB/s is payload bytes / seconds, GB = 1e9.

    ckptio bench io /mnt/ckpt --quick
    python -m ckptio.tuning.io_study /mnt/ckpt --reps 3 --out docs/results/io_full
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckptio.alignment import BLOCK, align_up
from ckptio.errors import CkptError
from ckptio.io.backend_contract import IOBackend
from ckptio.options import GiB, KiB, MiB
from ckptio.tuning import ceiling

# Cell, build_plan, gpt_sizes, engine_unavailable: also imported from here (tests, tune.py).
from ckptio.tuning.io_cells import (
    ENGINES,
    MODES,
    Cell,
    PhaseTimes,
    Plan,
    Run,
    build_plan,
    engine_unavailable,
    equal_sizes,
    gpt_sizes,
    make_backend,
    probe_unaligned_direct,
    run_phase,
)

__all__ = ["ENGINES", "MODES", "SECTIONS", "Cell", "Study", "StudyConfig", "build_plan",
           "config_from", "engine_unavailable", "gpt_sizes", "main", "make_cells", "parse_args",
           "parse_list", "parse_nbytes", "run_study"]

SECTIONS = ("sweep", "align", "layout", "mix", "extend")


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


# ---------------------------------------------------------------- the study


def _faulted(nbytes: int, pattern: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf.write(pattern * (nbytes // len(pattern)))  # every page touched before any clock starts
    return buf


def _first_missing(directory: Path) -> Path | None:
    """The outermost folder of ``directory`` (itself or a parent) that does not exist yet:
    what making it creates; None where it exists."""
    missing = None
    path = directory.absolute()
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


class Study:
    """The scratch directory, the two reused buffers and the backends of one run."""

    def __init__(self, directory: Path, config: StudyConfig) -> None:
        self.directory, self.config = directory, config
        self.root = directory / f".ckptio-io-study-{os.getpid()}"
        self._made = _first_missing(directory)  # the folder this run makes, removed after it
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
        shutil.rmtree(self.root if self._made is None else self._made, ignore_errors=True)
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
            chunk = min(chunk, align_up(nbytes))
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
    from ckptio.tuning.io_report import progress

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
    from ckptio.tuning import io_report

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
    from ckptio.tuning.io_plots import plots  # matplotlib, optional: imported when drawing

    io_report.write_all(runs, ceilings, meta, args.out, plots)
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
