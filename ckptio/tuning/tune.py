"""`ckptio tune DIR`: measure the filesystem holding DIR briefly, pick ckptio's fastest I/O
settings there, and store them as that filesystem's profile; `ckptio tune --show [DIR]` prints it.
`ckptio tune s3://bucket/prefix` does the same for an S3 endpoint (s3_tune.py).

Owns: the short study (O_DIRECT vs buffered first, then write size x depth for posix and, where it
runs, uring), the choice of engine and mode (choose(), pure) and what the command prints. Does
not own: measuring (io_study.py, io_cells.py), the best of one engine's cells (choice.py), the
profile file (profile.py), or applying a profile to Options (api/options).

The choice scores a configuration by the bytes of one save plus one load over their time (the
harmonic mean of write and read GB/s). Among scores within TIE of the best, the fewest threads
(io_depth), then the smallest buffer wins; uring is chosen only when its best beats posix's best by
more than URING_MARGIN. Only settings ckptio can run with its default pool are tried:
io_depth x buffer_bytes <= Options().pool_bytes (each write in flight holds one staging buffer).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ckptio.alignment import is_aligned
from ckptio.errors import CkptError
from ckptio.options import MiB
from ckptio.storage.select import scheme_of
from ckptio.tuning import profile
from ckptio.tuning.choice import TIE, Candidate, best_of

if TYPE_CHECKING:  # the study is imported only when tuning, not for --show
    from ckptio.tuning.io_study import Cell, Study

__all__ = ["TIE", "Candidate", "add_arguments", "best_of", "choose", "choose_mode", "main", "run"]

URING_MARGIN = 0.03
SIZES = "1M,4M,16M,64M"
POOL_DEPTHS = "1,2,4,8"
URING_DEPTHS = "4,16,32"
MODE_PROBE = (4, 16 * MiB)  # depth and write size at which O_DIRECT and buffered are compared


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """posix's best unless uring's best is more than URING_MARGIN faster."""
    posix = [c for c in candidates if c.engine == "posix"]
    uring = [c for c in candidates if c.engine == "uring"]
    if not posix or not uring:
        return best_of(posix or uring)
    if max(c.score for c in uring) > max(c.score for c in posix) * (1 + URING_MARGIN):
        return best_of(uring)
    return best_of(posix)


def choose_mode(candidates: Sequence[Candidate]) -> str:
    """O_DIRECT unless buffered is more than TIE faster (or O_DIRECT failed here)."""
    by_mode = {c.mode: c.score for c in candidates}
    if "direct" not in by_mode:
        return "buffered"
    return "buffered" if by_mode.get("buffered", 0.0) > by_mode["direct"] * (1 + TIE) else "direct"


# ---------------------------------------------------------------- measuring


def measure(study: Study, cells: Sequence[Cell]) -> list[Candidate]:
    """Median write and read GB/s of every cell over the study's repetitions; failed cells
    (O_DIRECT refused, say) are left out."""
    from ckptio.tuning import io_report, io_study
    from ckptio.tuning.io_cells import BACKEND_OF

    runs, _ = io_study.run_study(study, cells, with_ceiling=False)
    return [Candidate(BACKEND_OF[r["engine"]], r["mode"], r["write_nbytes"], r["depth"],
                      r["write_gbps"], r["read_gbps"])
            for r in io_report.summarize(runs, [])["rows"] if r["write_gbps"] and r["read_gbps"]]


def grid(sizes: Sequence[int], depths: Sequence[int], pool_bytes: int) -> list[tuple[int, int]]:
    return [(n, d) for n in sizes for d in depths if n * d <= pool_bytes]


def tune(directory: Path, total_nbytes: int, sizes: Sequence[int], pool_depths: Sequence[int],
         uring_depths: Sequence[int], reps: int) -> tuple[profile.Profile, list[Candidate]]:
    """Run the short study in ``directory`` and return the chosen profile and every candidate."""
    from ckptio.options import Options
    from ckptio.tuning.io_study import (
        MODES,
        Cell,
        Study,
        StudyConfig,
        engine_unavailable,
    )

    probe_depth, probe_size = MODE_PROBE
    config = StudyConfig(total_nbytes=total_nbytes, sizes=tuple(sizes), pool_depths=tuple(pool_depths),
                         uring_depths=tuple(uring_depths), modes=MODES, sections=(), align_sizes=(),
                         layout_sizes=(), extend_sizes=(), mix_chunk_nbytes=probe_size, reps=reps,
                         idle_s=0.0)
    pool_bytes = Options().pool_bytes
    with Study(directory, config) as study:
        probe = [Cell("equal", "aggregated", "posix_pool", probe_depth, m, probe_size) for m in MODES]
        mode = choose_mode(measure(study, probe))
        print(f"tune: {'O_DIRECT' if mode == 'direct' else 'buffered'} chosen; sweeping write size "
              "x depth", file=sys.stderr)
        engines = [("posix_pool", pool_depths)]
        if (why := engine_unavailable("uring", study.root)) is None:
            engines.append(("uring", uring_depths))
        else:
            print(f"tune: uring skipped: {why}", file=sys.stderr)
        cells = [Cell("equal", "aggregated", engine, d, mode, n)
                 for engine, depths in engines for n, d in grid(sizes, depths, pool_bytes)]
        candidates = measure(study, cells)
    if not candidates:
        raise CkptError(f"ckptio tune: no configuration could write and read {directory}; "
                        "see the errors above")
    return to_profile(choose(candidates), directory), candidates


def to_profile(c: Candidate, directory: Path) -> profile.Profile:
    device, fs_type = profile.filesystem_key(directory)
    return profile.Profile(
        io_backend=c.engine, direct_io="auto" if c.mode == "direct" else "off",
        buffer_bytes=c.buffer_bytes, io_depth=c.io_depth, fs_type=fs_type, device=device,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        write_gbps=round(c.write_gbps, 3), read_gbps=round(c.read_gbps, 3))


# ---------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ckptio.tuning import s3_tune

    p.add_argument("dir", nargs="?", help="a directory on the filesystem to tune, or "
                   "s3://bucket/prefix (the endpoint as for every s3:// path: AWS_ENDPOINT_URL)")
    p.add_argument("--show", action="store_true", help="print the stored profile(s) and exit")
    p.add_argument("--total", help=f"bytes per measurement (default 256M; s3: {s3_tune.TOTAL})")
    p.add_argument("--sizes", help=f"write sizes, >= 1M (default {SIZES}); s3: part sizes, "
                   f">= 5M (default {s3_tune.PARTS})")
    p.add_argument("--concurrency", default=s3_tune.CONCURRENCY,
                   help=f"s3: requests in flight (default {s3_tune.CONCURRENCY})")
    p.add_argument("--pool-depths", default=POOL_DEPTHS, help=f"posix threads ({POOL_DEPTHS})")
    p.add_argument("--uring-depths", default=URING_DEPTHS, help=f"uring depths ({URING_DEPTHS})")
    p.add_argument("--reps", type=int, default=2, help="repetitions, median taken (default 2)")


def describe(p: profile.Profile | profile.S3Profile) -> str:
    if isinstance(p, profile.S3Profile):
        from ckptio.tuning import s3_tune

        return s3_tune.describe(p)
    direct = "O_DIRECT" if p.direct_io != "off" else "buffered"
    return (f"{p.fs_type} (st_dev {p.device}): io_backend={p.io_backend} direct_io={p.direct_io} "
            f"({direct}) buffer_bytes={p.buffer_bytes} ({p.buffer_bytes / MiB:g} MiB) "
            f"io_depth={p.io_depth}; write {p.write_gbps:.2f} GB/s, read {p.read_gbps:.2f} GB/s, "
            f"measured {p.measured_at}")


def _key(target: str) -> tuple[str, str]:
    """The profile key of a directory or s3:// location, and how messages name it."""
    from ckptio.options import Options
    from ckptio.storage.s3.s3path import S3Path, is_s3
    from ckptio.storage.s3.settings import S3Settings

    if is_s3(target):
        S3Path.parse(target)
        endpoint = S3Settings.of(Options()).endpoint()
        return f"{profile.S3_KEY}{endpoint}", f"the S3 endpoint {endpoint}"
    device, fs_type = profile.filesystem_key(target)
    return f"{fs_type}:{device}", f"{target} ({fs_type}, st_dev {device})"


def show(target: str | None) -> int:
    path = profile.profile_path()
    try:
        profiles = profile.read_all(path)
    except FileNotFoundError:
        print(f"no ckptio I/O profile stored ({path} does not exist); run `ckptio tune DIR` to "
              "measure one")
        return 0
    except (OSError, profile.ProfileError) as exc:
        print(f"ckptio: cannot read the profile file: {exc}", file=sys.stderr)
        return 1
    if target is not None:
        key, named = _key(target)
        profiles = {k: v for k, v in profiles.items() if k == key}
        if not profiles:
            print(f"no profile for {named} in {path}; run `ckptio tune {target}`")
            return 0
    print(f"{path}:")
    for p in profiles.values():
        print(f"  {describe(p)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.show:
        return show(args.dir)
    if args.dir is None:
        print("ckptio tune: a directory or s3:// location is required (or --show)", file=sys.stderr)
        return 2
    profile.check_storable()  # before minutes of measuring, not after
    with _terminate_as_exit():
        if scheme_of(args.dir) == "s3":  # "S3://" too: its store says to write s3://
            return run_s3(args)
        return run_dir(args)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (``timeout``, a batch scheduler, ``kill``) ends the study as Ctrl-C does: by an
    exception, so its scratch files (and an S3 study's objects) are removed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    before = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_dir(args: argparse.Namespace) -> int:
    sizes, total, pool_depths, uring_depths = _study_args(args)
    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        raise CkptError(f"ckptio tune: {args.dir} is a file; give a directory on the filesystem "
                        f"to tune (its folder: ckptio tune {Path(args.dir).parent})")
    chosen, candidates = tune(Path(args.dir), total, sizes, pool_depths, uring_depths, args.reps)
    for c in sorted(candidates, key=lambda c: -c.score):
        print(f"  {c.engine:5s} d{c.io_depth:<3d} {c.buffer_bytes / MiB:5g} MiB {c.mode:8s} "
              f"write {c.write_gbps:5.2f} read {c.read_gbps:5.2f} score {c.score:5.2f} GB/s")
    where = profile.store(chosen)
    print(f"stored in {where}: {describe(chosen)}")
    return 0


def _study_args(args: argparse.Namespace) -> tuple[tuple[int, ...], int, tuple[int, ...],
                                                   tuple[int, ...]]:
    """The write sizes, bytes per measurement and the two engines' depths of a directory's
    study, checked: a CkptError names the option and an example before anything is measured."""
    from ckptio.options import MAX_IO_DEPTH
    from ckptio.tuning.io_study import parse_list, parse_nbytes

    try:
        sizes = parse_list(args.sizes or SIZES, parse_nbytes)
        total = parse_nbytes(args.total or "256M")
        depths = parse_list(args.pool_depths), parse_list(args.uring_depths)
    except (ValueError, IndexError) as exc:
        raise CkptError(f"ckptio tune: cannot read the sizes, total or depths ({exc}); write "
                        "e.g. --sizes 1M,4M --total 64M --pool-depths 1,4 --uring-depths 4,16") from None
    if not sizes or any(n < MiB or not is_aligned(n) for n in sizes):
        raise CkptError(f"ckptio tune: --sizes {args.sizes}: write sizes >= 1M and multiples "
                        "of 4K, e.g. --sizes 1M,4M,16M")
    if args.reps < 1:
        raise CkptError(f"ckptio tune: --reps {args.reps}: --reps >= 1 repetitions, e.g. --reps 2")
    if total < max(sizes):
        raise CkptError(f"ckptio tune: --total {args.total}: bytes per measurement must hold "
                        f"the largest write size ({max(sizes)} bytes), e.g. --total 256M")
    if not all(depths) or any(not 1 <= d <= MAX_IO_DEPTH for d in (*depths[0], *depths[1])):
        raise CkptError(f"ckptio tune: --pool-depths/--uring-depths: 1 to {MAX_IO_DEPTH} "
                        "writes in flight each, e.g. --pool-depths 1,2,4,8")
    return sizes, total, *depths


def run_s3(args: argparse.Namespace) -> int:
    from ckptio.tuning import s3_tune
    from ckptio.tuning.io_study import parse_list, parse_nbytes

    try:
        parts = parse_list(args.sizes or s3_tune.PARTS, parse_nbytes)
        concurrency = parse_list(args.concurrency)
        total = parse_nbytes(args.total or s3_tune.TOTAL)
    except ValueError as exc:
        raise CkptError(f"ckptio tune: cannot read the part sizes, requests or total ({exc}); "
                        "write e.g. --sizes 8M,16M --concurrency 2,4 --total 128M") from None
    chosen, candidates = s3_tune.tune(args.dir, total, parts, concurrency, args.reps)
    print("\n".join(s3_tune.table(candidates)))
    print(f"stored in {profile.store(chosen)}: {describe(chosen)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptio tune", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
