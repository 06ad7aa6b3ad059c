"""The raw client ceiling of benchmarks/s3.py: boto3 alone, moving S bytes as large parts.

A cell is (concurrency C, part size P). Writing a cell: one multipart upload of S bytes from one
page-aligned, pre-faulted anonymous mapping, every part a ``memoryview`` slice of it uploaded by
one of C threads, timed from CreateMultipartUpload to CompleteMultipartUpload returning.
Reading a cell (another fresh process, after the driver restarted the server and the page cache
was dropped): ranged GETs of P bytes, C at once, ``readinto`` a pre-faulted mapping of S bytes
(``--direct``: through http.client's readinto, bypassing urllib3's copy; an experiment;
``--cold-client``: the boto3 client made inside the clock, as any boto3 user's fresh process
makes it: what a fresh process pays once before its first byte, context for ckptio's
fresh-process loads, never the ceiling).
The client is ckptio's own (ckptio.storage.s3.client.client: payload signing off, checksums only when
required, path-style, no botocore retries), so the ceiling is what ckptio's client could do
with nothing else in the way. The bytes are the benchmark state's kind (fp32 from
ckptio.tuning.state.Filler): SeaweedFS gzips chunks whose first bytes compress, so zeros would
flatter the server.

    python -m benchmarks.s3_ceiling --phase write|read --gb 1 --cells 16x16 --prefix ceiling-r0 \
        --server-pid PID

prints one JSON line with a row per cell: seconds, client CPU (os.times), server CPU
(/proc/PID/stat); reads add the bitwise check against the written bytes.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.s3_peers import Counters

MiB = 1 << 20
BUCKET = "ckpt"
Cell = tuple[int, int]  # (concurrency, part bytes)


def parse_cells(spec: str) -> list[Cell]:
    """``4x8,16x16`` -> [(4, 8 MiB), (16, 16 MiB)]."""
    cells = []
    for item in filter(None, spec.split(",")):
        c, p = item.split("x")
        cells.append((int(c), int(p) * MiB))
    return cells


def cell_name(cell: Cell) -> str:
    return f"{cell[0]}x{cell[1] // MiB}"


def mapping(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, every page touched (no fault inside the clock)."""
    m = mmap.mmap(-1, nbytes)
    view = memoryview(m)
    for at in range(0, nbytes, mmap.PAGESIZE):
        view[at] = 0
    view.release()
    return m


def source(nbytes: int, seed: int) -> mmap.mmap:
    import torch

    from ckptio.tuning.state import Filler

    m = mapping(nbytes)
    floats = nbytes // 4
    Filler(seed).fill(torch.frombuffer(m, dtype=torch.float32, count=floats), 0.02)
    return m


def client_for(concurrency: int) -> Any:
    from ckptio.storage.s3.client import client
    from ckptio.storage.s3.settings import S3Settings

    return client(S3Settings(endpoint_url=os.environ["AWS_ENDPOINT_URL"], concurrency=concurrency))


def spans(nbytes: int, part: int) -> list[tuple[int, int]]:
    return [(at, min(part, nbytes - at)) for at in range(0, nbytes, part)]


def write_cell(view: memoryview, key: str, cell: Cell) -> None:
    conc, part = cell
    c = client_for(conc)
    upload = c.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]

    def put(i_span: tuple[int, tuple[int, int]]) -> dict[str, Any]:
        i, (at, n) = i_span
        answer = c.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=i + 1,
                               Body=view[at:at + n])
        return {"PartNumber": i + 1, "ETag": answer["ETag"]}

    with ThreadPoolExecutor(conc) as pool:
        parts = list(pool.map(put, enumerate(spans(len(view), part))))
    c.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload,
                                MultipartUpload={"Parts": parts})


def read_cell(view: memoryview, key: str, cell: Cell, direct: bool = False) -> None:
    """Ranged GETs of the cell's part size, ``concurrency`` at once, into ``view``.

    ``direct``: read each body with http.client's ``readinto`` (socket -> ``view``, one copy)
    instead of botocore's StreamingBody.readinto, which urllib3 2.x implements as
    ``read(n)`` into a new bytes object and a copy into ``view`` (an experiment: private
    attributes ``_raw_stream._fp``; the connection is handed back with ``release_conn``).
    The client is the process's (``client_for``): made here, inside the caller's clock, when
    the caller made none before it (``--cold-client``)."""
    conc, part = cell
    c = client_for(conc)

    def get(span: tuple[int, int]) -> int:
        at, n = span
        body = c.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={at}-{at + n - 1}")["Body"]
        into = body._raw_stream._fp.readinto if direct else body.readinto
        got = 0
        try:
            while got < n:
                k = into(view[at + got:at + n])
                if not k:
                    raise OSError(f"{key}: short body at {at + got}")
                got += k
        finally:
            if direct:
                body._raw_stream.release_conn()
            else:
                body.close()
        return got

    with ThreadPoolExecutor(conc) as pool:
        done = sum(pool.map(get, spans(len(view), part)))
    if done != len(view):
        raise OSError(f"{key}: read {done} of {len(view)} bytes")


def measure(fn: Any, args: argparse.Namespace) -> dict[str, float]:
    """Time one cell after an idle pause, with the CPU it cost (Counters)."""
    os.sync()
    time.sleep(args.idle)
    counters = Counters(args.server_pid)
    fn()
    return counters.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import xxhash

    from ckptio.tuning import ceiling, state

    nbytes = state.state_nbytes(state.gpt_config(args.gb))
    cells = parse_cells(args.cells)
    rows = []
    if args.phase == "write":
        m = source(nbytes, args.seed)
        view = memoryview(m)
        want = xxhash.xxh3_64(view).hexdigest()
        for cell in cells[:1]:  # untimed: clients, the server's volume for this bucket
            client_for(cell[0]).put_object(Bucket=BUCKET, Key=f"{args.prefix}/warmup",
                                           Body=view[:MiB])
        for cell in cells:
            key = f"{args.prefix}/{cell_name(cell)}"
            rows.append({"cell": cell_name(cell), "concurrency": cell[0], "part_mib": cell[1] // MiB,
                         **measure(lambda k=key, c=cell: write_cell(view, k, c), args)})
        return {"phase": "write", "bytes": nbytes, "digest": want, "cells": rows}
    m = mapping(nbytes)
    view = memoryview(m)
    if not args.cold_client:
        client_for(cells[0][0]).head_bucket(Bucket=BUCKET)  # untimed: the client
    else:
        import boto3  # noqa: F401 - imported before the clock, as the engines' modules are
        import ckptio.storage.s3.client  # noqa: F401 - client_for's import, not the client
    cache = ""
    for cell in cells:  # the driver restarts the server before a worker: pass one cell for cold
        key = f"{args.prefix}/{cell_name(cell)}"
        cache = ceiling.drop_page_cache()
        row = {"cell": cell_name(cell), "concurrency": cell[0], "part_mib": cell[1] // MiB,
               **measure(lambda k=key, c=cell: read_cell(view, k, c, args.direct), args)}
        row["digest"] = xxhash.xxh3_64(view).hexdigest()
        rows.append(row)
    phase = "read_cold" if args.cold_client else "read_direct" if args.direct else "read"
    return {"phase": phase, "bytes": nbytes,
            "cache_drop": cache, "cells": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_ceiling",
                                description="raw boto3 multipart write / ranged read sweep "
                                "(a worker of benchmarks.s3)")
    p.add_argument("--phase", choices=("write", "read"), required=True)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--cells", required=True, help="CONCURRENCYxPART_MIB,...")
    p.add_argument("--prefix", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--server-pid", type=int, default=0)
    p.add_argument("--direct", action="store_true", help="read with http.client readinto")
    p.add_argument("--cold-client", action="store_true",
                   help="read: make the boto3 client inside the clock (context, not a ceiling)")
    args = p.parse_args(argv)
    if args.cold_client and (args.direct or len(parse_cells(args.cells)) != 1):
        p.error("--cold-client reads one cell, through boto3 (one client per process)")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
