"""Which S3 client should carry ckptio's bytes? boto3 (explicit multipart from memoryviews,
ranged GETs with readinto, as ckptio.storage.s3.backend uses it), obstore (Rust object_store) and
s3torchconnectorclient (AWS's Mountpoint CRT client), raw, on one server, same bytes.

Runs in its own venv (obstore and s3torchconnectorclient are not ckptio dependencies; this file
imports nothing from ckptio, so no torch is needed), against a running server given by the
standard AWS_* variables (endpoint, keys, region). From the checkout's root (the venv goes under
its git-ignored .venv/):

    python3 -m venv .venv/peers/clients
    .venv/peers/clients/bin/pip install boto3 obstore s3torchconnectorclient
    AWS_ENDPOINT_URL=http://127.0.0.1:18333 AWS_ACCESS_KEY_ID=k AWS_SECRET_ACCESS_KEY=s \\
      AWS_REGION=us-east-1 .venv/peers/clients/bin/python benchmarks/s3_clients.py --gb 1 --reps 3

Per client: write (N objects of --object-mib, parts/chunks of --part-mib, --concurrency
requests in flight) and read back (ranged GETs of --part-mib into preallocated memory), GB/s
and the process's CPU seconds per GB, medians of --reps. Reads are from the server's page
cache (the same for every client): this compares clients, not the disk.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MiB = 1 << 20


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"set {name} (the server's endpoint, keys and region)")
    return value


def _memory(nbytes: int) -> memoryview:
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    for offset in range(0, nbytes, 4096):
        view[offset] = (offset // 4096) & 0xFF  # pre-faulted, not all zeros
    return view


class Boto3:
    name = "boto3 (ckptio's use)"

    def __init__(self, concurrency: int) -> None:
        import boto3
        from botocore.config import Config

        self.client = boto3.client("s3", endpoint_url=_env("AWS_ENDPOINT_URL"), config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"payload_signing_enabled": False, "addressing_style": "path"},
            retries={"total_max_attempts": 1}, max_pool_connections=concurrency + 8,
            parameter_validation=False))
        self.pool = ThreadPoolExecutor(concurrency)

    def write(self, bucket: str, key: str, data: memoryview, part: int) -> None:
        upload = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

        def one(k: int) -> dict[str, Any]:
            body = data[k * part:(k + 1) * part]
            etag = self.client.upload_part(Bucket=bucket, Key=key, UploadId=upload,
                                           PartNumber=k + 1, Body=body)["ETag"]
            return {"PartNumber": k + 1, "ETag": etag}

        parts = list(self.pool.map(one, range(-(-len(data) // part))))
        self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                              MultipartUpload={"Parts": parts})

    def read(self, bucket: str, key: str, into: memoryview, part: int) -> None:
        def one(k: int) -> None:
            start, end = k * part, min(len(into), (k + 1) * part)
            body = self.client.get_object(Bucket=bucket, Key=key,
                                          Range=f"bytes={start}-{end - 1}")["Body"]
            got = start
            while got < end:
                got += body.readinto(into[got:end])

        list(self.pool.map(one, range(-(-len(into) // part))))


class Obstore:
    name = "obstore"

    def __init__(self, concurrency: int) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore, self.concurrency, self.stores = obstore, concurrency, {}
        self.S3Store = S3Store

    def _store(self, bucket: str) -> Any:
        if bucket not in self.stores:
            self.stores[bucket] = self.S3Store(
                bucket, endpoint=_env("AWS_ENDPOINT_URL"), region=_env("AWS_REGION"),
                access_key_id=_env("AWS_ACCESS_KEY_ID"),
                secret_access_key=_env("AWS_SECRET_ACCESS_KEY"), client_options={"allow_http": True},
                virtual_hosted_style_request=False)
        return self.stores[bucket]

    def write(self, bucket: str, key: str, data: memoryview, part: int) -> None:
        chunks = [data[k:k + part] for k in range(0, len(data), part)]
        self.obstore.put(self._store(bucket), key, chunks, chunk_size=part,
                         max_concurrency=self.concurrency)

    def read(self, bucket: str, key: str, into: memoryview, part: int) -> None:
        starts = list(range(0, len(into), part))
        ends = [min(len(into), s + part) for s in starts]
        for start, end, got in zip(starts, ends, self.obstore.get_ranges(
                self._store(bucket), key, starts=starts, ends=ends)):
            into[start:end] = memoryview(got)


class Mountpoint:
    name = "s3torchconnectorclient (CRT)"

    def __init__(self, concurrency: int, part: int) -> None:
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

        self.client = MountpointS3Client(_env("AWS_REGION"), endpoint=_env("AWS_ENDPOINT_URL"),
                                         part_size=part, force_path_style=True)
        self.pool = ThreadPoolExecutor(concurrency)

    def write(self, bucket: str, key: str, data: memoryview, part: int) -> None:
        stream = self.client.put_object(bucket, key)
        for k in range(0, len(data), part):
            stream.write(bytes(data[k:k + part]))  # it takes bytes only: one copy
        stream.close()

    def read(self, bucket: str, key: str, into: memoryview, part: int) -> None:
        def one(start: int) -> None:
            end = min(len(into), start + part)
            at = start
            for chunk in self.client.get_object(bucket, key, start, end):
                into[at:at + len(chunk)] = chunk
                at += len(chunk)

        list(self.pool.map(one, range(0, len(into), part)))


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    cpu, wall = os.times(), time.perf_counter()
    fn()
    after = os.times()
    return time.perf_counter() - wall, (after.user - cpu.user) + (after.system - cpu.system)


def measure(client: Any, args: argparse.Namespace, source: memoryview,
            target: memoryview) -> dict[str, list[float]]:
    bucket, obj, part = args.bucket, args.object_mib * MiB, args.part_mib * MiB
    keys = [f"clients-{uuid.uuid4().hex}/{i}" for i in range(len(source) // obj)]
    out: dict[str, list[float]] = {"write_s": [], "write_cpu": [], "read_s": [], "read_cpu": []}
    with ThreadPoolExecutor(max(1, len(keys))) as objects:
        def writes() -> None:
            list(objects.map(lambda i: client.write(bucket, keys[i], source[i * obj:(i + 1) * obj],
                                                    part), range(len(keys))))

        def reads() -> None:
            list(objects.map(lambda i: client.read(bucket, keys[i], target[i * obj:(i + 1) * obj],
                                                   part), range(len(keys))))

        for _ in range(args.reps):
            for name, fn in (("write", writes), ("read", reads)):
                seconds, cpu = _timed(fn)
                out[f"{name}_s"].append(seconds)
                out[f"{name}_cpu"].append(cpu)
            if bytes(target[:4096]) != bytes(source[:4096]) or target[-1] != source[-1]:
                raise SystemExit(f"{client.name}: the bytes read back differ")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--object-mib", type=int, default=256)
    parser.add_argument("--part-mib", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket", default="ckpt")
    parser.add_argument("--clients", default="boto3,obstore,mountpoint")
    args = parser.parse_args()
    nbytes = int(args.gb * 1e9) // (args.object_mib * MiB) * args.object_mib * MiB
    source, target = _memory(nbytes), _memory(nbytes)
    makers = {"boto3": lambda: Boto3(args.concurrency), "obstore": lambda: Obstore(args.concurrency),
              "mountpoint": lambda: Mountpoint(args.concurrency, args.part_mib * MiB)}
    print(f"{nbytes / 1e9:.2f} GB in objects of {args.object_mib} MiB, parts {args.part_mib} MiB, "
          f"{args.concurrency} in flight, {args.reps} reps, {os.cpu_count()} CPUs (client and "
          "server share them); medians (min-max)\n")
    print("| client | write GB/s | write CPU s/GB | read GB/s | read CPU s/GB |")
    print("|---|---|---|---|---|")
    for name in args.clients.split(","):
        client = makers[name]()
        got = measure(client, args, source, target)
        gb = nbytes / 1e9
        print(f"| {client.name} | {_rate(gb, got['write_s'])} | "
              f"{statistics.median(got['write_cpu']) / gb:.2f} | {_rate(gb, got['read_s'])} | "
              f"{statistics.median(got['read_cpu']) / gb:.2f} |", flush=True)
    return 0


def _rate(gb: float, seconds: list[float]) -> str:
    """Median GB/s of several runs, with their range."""
    values = sorted(gb / s for s in seconds)
    return f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})"


if __name__ == "__main__":
    raise SystemExit(main())
