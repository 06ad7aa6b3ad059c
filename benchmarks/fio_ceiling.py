"""The storage's read ceiling by fio (Debian's ``fio``): io_uring, O_DIRECT, registered buffers
and files, sequential 16 MiB reads (ckptio's buffer size), 8 in flight, one process, from a
cold page cache; the file is fio's own, written the same way first (``fio_read_ceiling``), or
a checkpoint's own data files, one job per file, all at once (``fio_files_ceiling``: on this
virtual disk the same reads run at half or full speed from file to file). The project's ceiling tool
(ckptio.tuning.ceiling, Python threads over preadv) sits beside it in the same runs; fio is
the honest bound a C reader reaches (docs/BENCH_RESTART.md says why they differ).

Also ``fio_jobs_ceiling``: ``jobs`` files written (fsync at the end) then read cold at once, the
write and read bounds of benchmarks/dlio_run.py. The page cache is dropped through
benchmarks/harness.py's ``cold``; sizes are rounded by ckptio.alignment.

Owns: running fio and reading its JSON. Skipped (None) where fio is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.harness import cold
from ckptio.alignment import BLOCK, align_down, align_up

__all__ = ["JOB", "fio_files_ceiling", "fio_jobs_ceiling", "fio_read_ceiling"]

JOB = ["--ioengine=io_uring", "--direct=1", "--fixedbufs", "--registerfiles", "--bs=16m",
       "--iodepth=8", "--numjobs=1", "--output-format=json"]
READ = 16 << 20  # --bs: one read, ckptio's buffer size


def fio_read_ceiling(directory: Path, nbytes: int) -> dict[str, Any] | None:
    """-> {"read_s", "read_gbps", "command"} for reading ``nbytes`` cold, or None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    path = directory / "fio-ceiling.bin"
    size = f"--size={align_up(nbytes, READ)}"
    try:
        _run([fio, "--name=write", f"--filename={path}", "--rw=write", size, "--end_fsync=1",
              *JOB])
        cold([directory])
        command = [fio, "--name=read", f"--filename={path}", "--rw=read", size, *JOB]
        out = _run(command)
    finally:
        path.unlink(missing_ok=True)
    job = out["jobs"][0]["read"]
    seconds = job["runtime"] / 1000  # ms
    return {"read_s": seconds * nbytes / job["io_bytes"], "read_gbps": job["bw_bytes"] / 1e9,
            "command": " ".join(["fio", *command[1:]])}


def fio_files_ceiling(paths: list[Path]) -> dict[str, Any] | None:
    """-> {"read_s", "read_bytes", "command"}: every file in ``paths`` read cold at once, one fio
    job each, until the last job ends; None without fio."""
    fio = shutil.which("fio")
    paths = [p for p in paths if p.stat().st_size >= BLOCK]
    if fio is None or not paths:
        return None
    cold(sorted({p.parent for p in paths}))
    command = [fio, *JOB, "--rw=read", "--readonly"]
    for i, path in enumerate(paths):  # a file smaller than a read is read in one
        bs = min(READ, align_down(path.stat().st_size))
        command += [f"--name=file{i}", f"--filename={path}", f"--bs={bs}"]
    jobs = [job["read"] for job in _run(command)["jobs"]]
    return {"read_s": max(job["runtime"] for job in jobs) / 1000,
            "read_bytes": sum(job["io_bytes"] for job in jobs),
            "command": " ".join(["fio", *JOB, "--rw=read", "--readonly",
                                 f"--name=fileI --filename=<data file I> (x{len(paths)})"])}


def fio_jobs_ceiling(directory: Path, nbytes: int, jobs: int) -> dict[str, Any]:
    """fio writing (fsync at the end) then reading cold ``nbytes`` in ``jobs`` files at once, in
    a folder of ``directory`` removed after: {"bytes", "write_GBps", "read_GBps" (GiB/s, DLIO's
    "GB"), "write_s", "read_s", "command"}."""
    path = directory / "fio"
    path.mkdir(parents=True, exist_ok=True)
    each = align_up(-(-nbytes // jobs), READ)
    common = [f"--directory={path}", f"--size={each}", "--group_reporting", *JOB[:-2],
              f"--numjobs={jobs}", "--output-format=json"]
    try:
        w = _run(["fio", "--name=ckpt", "--rw=write", "--end_fsync=1", *common])["jobs"][0]["write"]
        cold([path])
        r = _run(["fio", "--name=ckpt", "--rw=read", *common])["jobs"][0]["read"]
    finally:
        shutil.rmtree(path, ignore_errors=True)
    gib = 1024 ** 3  # DLIO's "GB"
    return {"bytes": each * jobs, "write_GBps": w["bw_bytes"] / gib, "read_GBps": r["bw_bytes"] / gib,
            "write_s": w["runtime"] / 1000, "read_s": r["runtime"] / 1000,
            "command": "fio " + " ".join(common) + " --name=ckpt --rw=write|read"}


def _run(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout[done.stdout.index("{"):])
