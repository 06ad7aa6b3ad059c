"""`ckptio tune s3://bucket/prefix`: measure an S3 endpoint briefly, pick the requests in flight
and the part size ckptio's saves and loads use there, and store them as that endpoint's profile.

Call order: ``tune`` -> ``check`` (the arguments) -> ``study`` (prepare the location as a save
does, then write and read every cell; how: on ``study``) -> ``to_profile`` (uploads by
choice.best_of, a load's reads by ``read_choice``) -> the caller writes the profile and prints
``describe`` / ``table``. Endpoint, region and credentials come as for every s3:// path
(storage/s3/client.py); the profile's key is the endpoint as S3Settings.endpoint() names it.

Owns: the S3 study (study(), Cell), to_profile(), what `ckptio tune s3://...` prints. Does not
own: the choice rule (tune.py), the profile file (profile.py), talking to S3 (storage/s3/).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import datetime, timezone

from ckptio.alignment import is_aligned
from ckptio.errors import CkptError
from ckptio.options import MiB, Options
from ckptio.storage.s3.backend import MIN_PART, S3Backend
from ckptio.storage.s3.client import call, client, failed
from ckptio.storage.s3.s3path import S3Path
from ckptio.storage.s3.settings import S3Settings, gets_in_flight
from ckptio.storage.s3.store import S3Store
from ckptio.tuning import profile
from ckptio.tuning.choice import Candidate, best_of

__all__ = ["CONCURRENCY", "PARTS", "READS", "READ_TIE", "TOTAL", "cells", "describe",
           "read_choice", "study", "table", "to_profile", "tune"]

CONCURRENCY = "2,4,8,16"
PARTS = "8M,16M,32M,64M"
TOTAL = "128M"
READS = 3  # read passes per repetition (each cell reads another cell's object each time)
# reads within this of the default's cell are a tie: wider than the write side's TIE, as the
# study's warm reads jump between neighbouring cells (docs/BENCH_S3.md, "where a load's CPU
# went, and the read side of the tuner")
READ_TIE = 0.10


def cells(parts: Sequence[int], concurrency: Sequence[int], pool_bytes: int) -> list[tuple[int, int]]:
    """(part bytes, requests in flight) pairs a default pool can hold."""
    return [(p, c) for p in parts for c in concurrency if p * c <= pool_bytes]


def check(parts: Sequence[int], concurrency: Sequence[int], total: int, reps: int) -> None:
    if not parts or not concurrency or reps < 1:
        raise CkptError("ckptio tune: give at least one part size, one number of requests in "
                        "flight and --reps >= 1")
    if any(p < MIN_PART or not is_aligned(p) for p in parts):
        raise CkptError(f"ckptio tune: part sizes {list(parts)} must be >= 5M (S3's smallest "
                        "part) and multiples of 4K")
    if any(c < 1 for c in concurrency) or total < max(parts):
        raise CkptError("ckptio tune: requests in flight must be >= 1 and --total at least the "
                        "largest part size")


def study(location: str, settings: S3Settings, total: int, parts: Sequence[int],
          concurrency: Sequence[int], reps: int, reads: int = READS) -> list[Candidate]:
    """Median write and read GB/s of every cell (requests in flight x part size); ``reads``
    read passes per repetition.

    Each cell writes one object of ``total`` bytes through ckptio's own S3 backend (storage/s3/backend.py:
    a multipart upload of whole parts); once every cell of the repetition has written, each
    cell reads with its settings (ranged GETs of one part each into memory, that many in
    flight) an object ANOTHER cell wrote earlier, never its own, ``reads`` times (reads are
    fast and their warm throughput noisy, so they get more samples than writes). Repetitions
    alternate the cells' order; medians are taken. Only cells ckptio can run with its default
    pool are tried (requests x part <= Options().pool_bytes: each request in flight holds one
    staging buffer). The objects live under ``PREFIX/.ckptio-tune-<id>/``; each repetition's
    are deleted when it ends and again (by name, only the names it wrote) when the study ends,
    failed or not. Reads still come back from wherever the store keeps recently written bytes:
    the study cannot drop a remote store's cache. Before measuring, the location is checked as
    a save checks it (S3Store.prepare: bucket, access, conditional writes), so a wrong
    endpoint, missing credentials or a missing bucket fail within seconds as one CkptError."""
    S3Store(location, settings).prepare()  # bucket, access, conditional writes: fails fast
    grid = cells(parts, concurrency, Options().pool_bytes)
    if not grid:
        raise CkptError("ckptio tune: no (part size, requests) cell fits the default staging "
                        f"pool of {Options().pool_bytes // MiB} MiB; choose smaller ones")
    run = S3Path.parse(location).child(f".ckptio-tune-{uuid.uuid4().hex[:12]}")
    source = memoryview(os.urandom(max(parts)))  # random: a store that compresses gains nothing
    dest = memoryview(bytearray(b"\1") * max(p * c for p, c in grid))  # touched: no faults timed
    written: list[S3Path] = []
    write_s: dict[tuple[int, int], list[float]] = {cell: [] for cell in grid}
    read_s: dict[tuple[int, int], list[float]] = {cell: [] for cell in grid}
    try:
        for rep in range(reps):
            order = grid if rep % 2 == 0 else grid[::-1]
            objects = [run.child(f"p{part}-c{depth}-r{rep}") for part, depth in order]
            written += objects
            for where, cell in zip(objects, order):
                write_s[cell].append(_write(settings, where, total, *cell, source))
            for shift in range(1, reads + 1):
                for i, cell in enumerate(order):  # another cell's object: written earlier
                    other = objects[(i + shift) % len(objects)]
                    read_s[cell].append(_read(settings, other, total, *cell, dest))
            for where in objects:
                _delete(settings, where)
    except BaseException as exc:
        _remove(settings, written, exc)
        raise
    return [Candidate("s3", "s3", part, depth,
                      total / 1e9 / statistics.median(write_s[(part, depth)]),
                      total / 1e9 / statistics.median(read_s[(part, depth)]))
            for part, depth in grid]


def _write(settings: S3Settings, where: S3Path, total: int, part: int, depth: int,
           source: memoryview) -> float:
    """Seconds to upload ``where``: ``total`` bytes as whole parts, ``depth`` in flight."""
    backend = S3Backend(dataclasses.replace(settings, concurrency=depth), part)
    try:
        began = time.perf_counter()
        fh = backend.open_write(where.url, total)
        writes = [backend.submit_write(fh, offset, source[:min(part, total - offset)])
                  for offset in range(0, total, part)]
        for future in writes:
            future.exception()  # close() raises the first failure and aborts the upload
        backend.close(fh, sync=True)
        return time.perf_counter() - began
    finally:
        backend.shutdown()


def _read(settings: S3Settings, where: S3Path, total: int, part: int, depth: int,
          dest: memoryview) -> float:
    """Seconds to read ``where`` back with ranged GETs of ``part`` bytes, ``depth`` in flight
    (each into a buffer of its own, as a load's reads)."""
    backend = S3Backend(dataclasses.replace(settings, concurrency=depth, read_concurrency=depth,
                                            read_bytes=0), part)
    try:
        began = time.perf_counter()
        fh = backend.open_read(where.url)
        pending: deque[Future[int]] = deque()
        for i, offset in enumerate(range(0, total, part)):
            if len(pending) >= depth:
                pending.popleft().result()  # its slot is the one this read reuses
            slot = (i % depth) * part
            pending.append(backend.submit_read(fh, offset, dest[slot:slot + part]))
        while pending:
            pending.popleft().result()
        backend.close(fh, sync=False)
        return time.perf_counter() - began
    finally:
        backend.shutdown()


def _delete(settings: S3Settings, where: S3Path) -> None:
    c = client(settings)
    try:
        call(settings, f"removing {where.url}", lambda: c.delete_object(Bucket=where.bucket,
                                                                        Key=where.key))
    except Exception as exc:  # mapped to StorageIOError naming the object
        raise failed(f"removing the study's object {where.url}", exc) from exc


def _remove(settings: S3Settings, written: Sequence[S3Path], cause: BaseException) -> None:
    """After a failed study: delete every object it wrote (by name, nothing else); those that
    cannot be deleted are named on ``cause``, which stays the error raised."""
    left = []
    for where in written:
        try:
            _delete(settings, where)
        except CkptError:
            left.append(where.url)
    if left:
        note = (f"ckptio tune could not remove its objects {', '.join(left)}; delete them by "
                "hand")
        add_note = getattr(cause, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            add_note(note)
        else:
            print(note, file=sys.stderr)


def read_choice(candidates: Sequence[Candidate], buffer: int) -> Candidate | None:
    """The read cell a load with staging buffers of ``buffer`` bytes should run like (its part
    size: the bytes of one GET; its requests: the GETs in flight), from the read column alone,
    among the cells whose part fits the buffer; None (read like a load without a profile)
    where the default's cell is measured and no cell reads more than READ_TIE faster.

    The default's cell is GETs of Options().buffer_bytes, 2 x Options().io_depth in flight
    (what a load without a profile does). Reads that tie cannot justify a change: taking the
    write side's requests or part size for the reads made loads slower (docs/BENCH_S3.md,
    "the tuner learns the object store" and "the read side of the tuner")."""
    mine = [c for c in candidates if c.buffer_bytes <= buffer]
    if not mine:
        return None
    best = max(mine, key=lambda c: c.read_gbps)
    default = _default_cell(mine, buffer)
    if default is not None and best.read_gbps <= default.read_gbps * (1 + READ_TIE):
        return None
    return best


def _default_reads(buffer: int) -> tuple[int, int]:
    """(bytes of one GET, GETs in flight) of a load at the default io_depth and buffer size
    (the buffer's own size where the default is larger), within the default pool."""
    span = min(Options().buffer_bytes, buffer)
    return span, min(gets_in_flight(Options().io_depth), Options().pool_bytes // span)


def _default_cell(candidates: Sequence[Candidate], buffer: int) -> Candidate | None:
    span, gets = _default_reads(buffer)
    return next((c for c in candidates if (c.buffer_bytes, c.io_depth) == (span, gets)), None)


def to_profile(candidates: Sequence[Candidate], endpoint: str) -> profile.S3Profile:
    """Uploads in flight and the part size: the best score (choice.best_of); a load's GETs:
    read_choice (its part size is ``read_bytes``; ``depth`` GETs in flight = io_depth
    ceil(depth / 2), as a load keeps 2 x io_depth); on a tie, the default's reads."""
    chosen = best_of(candidates)
    reads = read_choice(candidates, chosen.buffer_bytes)
    if reads is None:
        io_depth, read_bytes = Options().io_depth, _default_reads(chosen.buffer_bytes)[0]
        default = _default_cell(candidates, chosen.buffer_bytes)
        read_gbps = chosen.read_gbps if default is None else default.read_gbps
    else:
        io_depth, read_bytes = -(-reads.io_depth // 2), reads.buffer_bytes
        read_gbps = reads.read_gbps
    return profile.S3Profile(
        endpoint=endpoint, s3_concurrency=chosen.io_depth, buffer_bytes=chosen.buffer_bytes,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        write_gbps=round(chosen.write_gbps, 3), read_gbps=round(read_gbps, 3), io_depth=io_depth,
        read_bytes=read_bytes)


def tune(location: str, total: int, parts: Sequence[int], concurrency: Sequence[int],
         reps: int) -> tuple[profile.S3Profile, list[Candidate]]:
    """Run the study at ``location`` (endpoint etc. from the environment, as Options() takes
    them) and return the chosen profile and every candidate."""
    check(parts, concurrency, total, reps)
    settings = S3Settings.of(Options())
    print(f"tune: {settings.endpoint()}: {len(cells(parts, concurrency, Options().pool_bytes))} "
          f"cells x {reps} reps of {total / MiB:g} MiB under {location}", file=sys.stderr)
    candidates = study(location, settings, total, parts, concurrency, reps)
    return to_profile(candidates, settings.endpoint()), candidates


def describe(p: profile.S3Profile) -> str:
    return (f"S3 {p.endpoint}: s3_concurrency={p.s3_concurrency} "
            f"io_depth={p.io_depth or p.s3_concurrency} "
            f"buffer_bytes={p.buffer_bytes} ({p.buffer_bytes / MiB:g} MiB parts) "
            f"s3_read_bytes={p.read_bytes or p.buffer_bytes} "
            f"({(p.read_bytes or p.buffer_bytes) / MiB:g} MiB GETs); write "
            f"{p.write_gbps:.3f} GB/s, read {p.read_gbps:.3f} GB/s, measured {p.measured_at}")


def table(candidates: Sequence[Candidate]) -> list[str]:
    return [f"  s3 {c.io_depth:3d} in flight {c.buffer_bytes / MiB:5g} MiB parts  write "
            f"{c.write_gbps:6.3f} read {c.read_gbps:6.3f} score {c.score:6.3f} GB/s"
            for c in sorted(candidates, key=lambda c: -c.score)]
