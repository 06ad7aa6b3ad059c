"""The S3 engines of benchmarks/s3.py and the worker that times one save or one cold load.

Each engine saves a state to an ``s3://bucket/prefix`` URL and loads it back in place:

- ``ckptio`` at its defaults (no tuned profile); ``ckptio_tuned`` with the endpoint's tuned
  profile (benchmarks/s3_tune.py); ``ckptio_tuned_prepared`` the same through a
  ``Checkpointer`` whose ``prepare(url)`` ran before the clock (a job's startup: pool, backend
  and boto3 client made, as the raw ceiling makes its client before its clock); ``ckptio_best``
  with ``s3_concurrency`` = the best concurrency of the raw client sweep (``--concurrency``);
  ``ckptio[field=value,...]`` any Options overrides (experiments:
  ``ckptio[io_depth=8,pool_bytes=512MiB]``);
- ``dcp_fsspec_tK``: torch.distributed.checkpoint through ``FsspecWriter/FsspecReader`` on s3fs
  (thread_count K), what DCP users write to S3 today;
- ``dcp_s3tc_tK``: DCP through s3torchconnector's ``S3StorageWriter/S3StorageReader`` (AWS's
  CRT-based mountpoint client, thread_count K);
- ``torchsnapshot``: TorchSnapshot's S3 storage plugin (aiobotocore).

The peers need s3fs, aiobotocore, s3torchconnector and torchsnapshot, whose botocore pin
conflicts with ckptio's boto3: they run in their own venv (benchmarks/s3_setup.sh) with this
checkout on PYTHONPATH, which is why this module imports nothing but torch and the stdlib at
the top. ckptio's engines run with the main venv's python.

Worker (one fresh process per phase; the driver restarts the server between them):

    python -m benchmarks.s3_peers --phase save|load --engine NAME --url s3://ckpt/x --gb 1 \
        --server-pid PID [--concurrency C]

prints one JSON line: seconds, process CPU (user+sys, os.times), the server's CPU
(/proc/PID/stat), peak extra RSS (VmHWM reset through clear_refs), bitwise check.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.s3_patches import PATCHES

REGION = "us-east-1"
MAIN, PEER = "main", "peer"  # which venv's python runs an engine


@dataclass(frozen=True)
class S3Engine:
    name: str
    venv: str  # MAIN or PEER
    save: Callable[[Any, str, argparse.Namespace], None]
    load: Callable[[str, Any, argparse.Namespace], object]
    note: str
    modules: tuple[str, ...] = ()  # imported before anything is timed
    prepare: Callable[[str, argparse.Namespace], None] | None = None  # before a load's clock


# Imported before the clock, as the peers' modules are: ``import ckptio`` alone imports none of
# its API (first use does, compiling it where no .pyc is kept: 0.3 s of a 1.3 s load, round 3).
CKPTIO_MODULES = ("ckptio", "ckptio.shared", "ckptio.api", "boto3")


def endpoint() -> str:
    return os.environ["AWS_ENDPOINT_URL"]


# ---------------------------------------------------------------- ckptio

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_overrides(spec: str) -> dict[str, Any]:
    """``io_depth=8,pool_bytes=512MiB`` -> {"io_depth": 8, "pool_bytes": 536870912}."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, raw = item.partition("=")
        unit = next((u for u in _UNITS if raw.endswith(u)), None)
        if unit:
            out[key] = int(float(raw[: -len(unit)]) * _UNITS[unit])
        elif re.fullmatch(r"-?\d+", raw):
            out[key] = int(raw)
        elif re.fullmatch(r"-?\d*\.\d+", raw):
            out[key] = float(raw)
        else:
            out[key] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


def ckptio_overrides(name: str, args: argparse.Namespace, phase: str) -> dict[str, Any]:
    name = name.split("+")[0]
    if name == "ckptio_best":
        best = args.concurrency if phase == "save" else (args.read_concurrency or args.concurrency)
        return {"s3_concurrency": best} if best else {}
    match = re.fullmatch(r"ckptio\[(.*)\]", name)
    return parse_overrides(match.group(1)) if match else {}


def _ckptio_options(args: argparse.Namespace, phase: str) -> Any:
    import ckptio

    return ckptio.Options(s3_endpoint_url=endpoint(),
                          use_profile=args.engine.split("+")[0].startswith("ckptio_tuned"),
                          **ckptio_overrides(args.engine, args, phase))


def _ckptio_save(state: Any, url: str, args: argparse.Namespace) -> None:
    import ckptio

    ckptio.save(state, url, options=_ckptio_options(args, "save"))


def _ckptio_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    import ckptio

    return ckptio.load(url, dest, options=_ckptio_options(args, "load"))


_prepared: dict[str, Any] = {}  # the Checkpointer ckptio_tuned_prepared made before the clock


def _ckptio_prepare(url: str, args: argparse.Namespace) -> None:
    import ckptio

    checkpointer = _prepared["checkpointer"] = ckptio.Checkpointer(_ckptio_options(args, "load"))
    checkpointer.prepare(url)


def _ckptio_prepared_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    return _prepared["checkpointer"].load(url, dest)


# ---------------------------------------------------------------- DCP over fsspec / s3fs


def _tc_manager(url: str, args: argparse.Namespace) -> tuple[Any, str]:
    """torch_checkpointing's sync CheckpointManager over ckptio's storage (ckptio/tc_storage.py)
    rooted at ``url``'s parent -> (it, the checkpoint id: ``url``'s last name)."""
    from torch_checkpointing import CheckpointManager

    from ckptio.tc_storage import CkptioStorageConfig

    parent, name = url.rstrip("/").rsplit("/", 1)
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = CkptioStorageConfig(parent, _ckptio_options(args, "save"))
    return config.build(), name


def _tc_save(state: Any, url: str, args: argparse.Namespace) -> None:
    manager, name = _tc_manager(url, args)
    manager.save(name, {"state": state})
    manager.close()


def _tc_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    manager, name = _tc_manager(url, args)
    manager.load(name, into={"state": dest})
    manager.close()
    return None


def _fsspec_kwargs() -> dict[str, Any]:
    return {"endpoint_url": endpoint()}  # keys and region: AWS_* environment


def _dcp_fsspec_save(threads: int) -> Callable[[Any, str, argparse.Namespace], None]:
    def save(state: Any, url: str, args: argparse.Namespace) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(url, thread_count=threads, sync_files=True, **_fsspec_kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
    return save


def _dcp_fsspec_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=FsspecReader(url, **_fsspec_kwargs()), no_dist=True)
    return None


# ---------------------------------------------------------------- DCP over s3torchconnector


def _s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)  # endpoint: AWS_ENDPOINT_URL (CRT reads it)


def _dcp_s3tc_save(threads: int) -> Callable[[Any, str, argparse.Namespace], None]:
    def save(state: Any, url: str, args: argparse.Namespace) -> None:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(REGION, url, s3client_config=_s3tc_config(), thread_count=threads)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
    return save


def _dcp_s3tc_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=S3StorageReader(REGION, url, s3client_config=_s3tc_config()),
                 no_dist=True)
    return None


# ---------------------------------------------------------------- TorchSnapshot


def _snapshot_save(state: Any, url: str, args: argparse.Namespace) -> None:
    from torchsnapshot import Snapshot

    from benchmarks.engines import DictStateful

    Snapshot.take(path=url, app_state={"state": DictStateful(state)})


def _snapshot_load(url: str, dest: Any, args: argparse.Namespace) -> object:
    from torchsnapshot import Snapshot

    from benchmarks.engines import DictStateful

    Snapshot(path=url).restore(app_state={"state": DictStateful(dest)})
    return None


# ---------------------------------------------------------------- registry

DCP = ("torch.distributed.checkpoint",)
ENGINES: dict[str, S3Engine] = {
    "ckptio": S3Engine("ckptio", MAIN, _ckptio_save, _ckptio_load,
                       "ckptio.save (committed when it returns) / ckptio.load in place, "
                       "default Options", CKPTIO_MODULES),
    "ckptio_best": S3Engine("ckptio_best", MAIN, _ckptio_save, _ckptio_load,
                            "ckptio with s3_concurrency = the best concurrency of the raw "
                            "client sweep (write cell for save, read cell for load)",
                            CKPTIO_MODULES),
    "ckptio_tuned": S3Engine("ckptio_tuned", MAIN, _ckptio_save, _ckptio_load,
                             "ckptio.save / ckptio.load with no options but the endpoint: the "
                             "endpoint's tuned profile (`ckptio tune s3://...`, "
                             "CKPTIO_PROFILE_PATH) applies", CKPTIO_MODULES),
    "ckptio_tuned_prepared": S3Engine(
        "ckptio_tuned_prepared", MAIN, _ckptio_save, _ckptio_prepared_load,
        "ckptio_tuned's save; its load through a Checkpointer whose prepare(url) ran before the "
        "clock (pool, backend, boto3 client: a job's startup)", CKPTIO_MODULES,
        prepare=_ckptio_prepare),
    **{f"dcp_fsspec_t{k}": S3Engine(
        f"dcp_fsspec_t{k}", PEER, _dcp_fsspec_save(k), _dcp_fsspec_load,
        f"DCP FsspecWriter(thread_count={k}) / FsspecReader on s3fs (defaults), no process group",
        DCP + ("s3fs",)) for k in (1, 2, 4, 8)},
    **{f"dcp_s3tc_t{k}": S3Engine(
        f"dcp_s3tc_t{k}", PEER, _dcp_s3tc_save(k), _dcp_s3tc_load,
        f"DCP with s3torchconnector S3StorageWriter(thread_count={k}) / S3StorageReader "
        "(CRT client, force_path_style)", DCP + ("s3torchconnector.dcp",)) for k in (1, 4, 8)},
    "torch_checkpointing": S3Engine(
        "torch_checkpointing", MAIN, _tc_save, _tc_load,
        "torch_checkpointing 0.1.1's sync CheckpointManager (save / load(into=...), one "
        "torch.save file per item and rank) with storage_config=ckptio.tc_storage."
        "CkptioStorageConfig(s3://...)", CKPTIO_MODULES + ("torch_checkpointing",)),
    "torchsnapshot": S3Engine("torchsnapshot", PEER, _snapshot_save, _snapshot_load,
                              "TorchSnapshot Snapshot.take / restore, its S3 plugin "
                              "(aiobotocore)", ("torchsnapshot",)),
}


def engine(name: str) -> S3Engine:
    """The engine called ``name``; ``ckptio[k=v,...]`` is ckptio with those Options, and a
    ``+patch`` suffix (ckptio only) a prototype of a change to ckptio (PATCHES)."""
    base, *patches = name.split("+")
    unknown = [p for p in patches if p not in PATCHES]
    if unknown or (patches and not base.startswith("ckptio")):
        raise KeyError(f"{name!r}: patches apply to ckptio engines only; known: {', '.join(PATCHES)}")
    if base in ENGINES:
        found = ENGINES[base]
    elif re.fullmatch(r"ckptio\[.*\]", base):
        parse_overrides(base[7:-1])
        found = S3Engine(base, MAIN, _ckptio_save, _ckptio_load,
                         f"ckptio with Options({base[7:-1]})", CKPTIO_MODULES)
    else:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}, "
                       "ckptio[field=value,...]")
    if not patches:
        return found
    notes = "; ".join(PATCHES[p][1] for p in patches)
    return S3Engine(name, MAIN, found.save, found.load, f"{found.note}; PROTOTYPE: {notes}",
                    found.modules, found.prepare)


# ---------------------------------------------------------------- measuring one phase


def proc_cpu(pid: int | None) -> float:
    """user+sys CPU seconds of process ``pid`` (all its threads), from /proc/PID/stat."""
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def system_cpu() -> float:
    """Busy CPU seconds of the whole machine (user+nice+system+irq+softirq, /proc/stat): minus
    the client's and the server's, what other processes took during a phase."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Counters:
    """Wall clock and CPU of this process, the server and the machine, from start to stop()."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid
        self.t0, self.cpu0 = time.perf_counter(), self_cpu()
        self.srv0, self.sys0 = proc_cpu(server_pid), system_cpu()

    def stop(self) -> dict[str, float]:
        seconds = time.perf_counter() - self.t0
        cpu, srv = self_cpu() - self.cpu0, proc_cpu(self.pid) - self.srv0
        return {"seconds": seconds, "cpu_s": cpu, "server_cpu_s": srv,
                "other_cpu_s": system_cpu() - self.sys0 - cpu - srv}


def timed(fn: Callable[[], object], args: argparse.Namespace, *, reset: bool = True,
          rss_base: float | None = None) -> dict[str, Any]:
    """Idle, then run ``fn`` with the clock, CPU counters and the RSS peak around it.
    ``rss_base``: RSS (KiB) to measure the peak from, instead of just before ``fn``."""
    from benchmarks.engines import release_free_heap, reset_peak_rss, status_kib

    gc.collect()
    release_free_heap()
    os.sync()
    time.sleep(args.idle)
    before = status_kib("VmRSS") if rss_base is None else rss_base
    peak_reset = reset_peak_rss() if reset else True
    counters = Counters(args.server_pid)
    fn()
    return {**counters.stop(), "rss_mib": (status_kib("VmHWM") - before) / 1024,
            "peak_reset": peak_reset}


WARM_LOAD = "S3BENCH_WARM_LOAD"  # =1: an untimed load of the warm-up checkpoint first


def warmup_state() -> dict[str, Any]:
    """The 1 MiB state saved (untimed) before the timed save, to a URL of its own."""
    return {"warm": torch.arange(1 << 18, dtype=torch.float32), "step": 0}


def save_phase(args: argparse.Namespace, eng: S3Engine) -> dict[str, Any]:
    from benchmarks.engines import release_free_heap, reset_peak_rss, status_kib
    from ckptio.tuning import state

    src = state.build_state(args.gb, args.seed)
    nbytes, want = state.tensor_nbytes(src), state.digest(src)
    gc.collect()
    release_free_heap()
    base = status_kib("VmRSS")
    reset_peak_rss()
    # untimed warm-up: clients, sessions, thread pools, the staging pool, the server's volume
    t0 = time.perf_counter()
    eng.save(warmup_state(), args.url + "-warmup", args)
    warm_s = time.perf_counter() - t0
    out = timed(lambda: eng.save(src, args.url, args), args, reset=False, rss_base=base)
    return {**out, "bytes": nbytes, "digest": want, "warmup_s": warm_s,
            "tensors": len(state.tensor_leaves(src))}


def load_phase(args: argparse.Namespace, eng: S3Engine) -> dict[str, Any]:
    from ckptio.tuning import ceiling, state

    src = state.build_state(args.gb, args.seed)
    nbytes, want = state.tensor_nbytes(src), state.digest(src)
    dest = state.empty_destination(src)
    del src
    gc.collect()
    state.prefault(dest)
    warm_s = None
    if os.environ.get(WARM_LOAD) == "1":  # experiment: clients and pools made outside the clock
        t0 = time.perf_counter()
        eng.load(args.url + "-warmup", state.empty_destination(warmup_state()), args)
        warm_s = time.perf_counter() - t0
    if eng.prepare is not None:  # a job's startup, before the clock (ckptio_tuned_prepared)
        t0 = time.perf_counter()
        eng.prepare(args.url, args)
        warm_s = time.perf_counter() - t0
    cache = ceiling.drop_page_cache()  # the server was restarted too: nothing is warm
    out = timed(lambda: eng.load(args.url, dest, args), args)
    return {**out, "bytes": nbytes, "digest": want, "cache_drop": cache, "warmup_s": warm_s,
            "bitwise_ok": state.digest(dest) == want}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3_peers",
                                description="one timed S3 save or cold load (a worker of "
                                "benchmarks.s3)")
    p.add_argument("--phase", choices=("save", "load", "probe"), required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--url", default="")
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle", type=float, default=2.0)
    p.add_argument("--server-pid", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=0, help="ckptio_best: s3_concurrency")
    p.add_argument("--read-concurrency", type=int, default=0, help="ckptio_best load")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import importlib

    args = parse_args(argv)
    eng = engine(args.engine)
    for module in eng.modules:
        importlib.import_module(module)
    for patch in args.engine.split("+")[1:]:
        PATCHES[patch][0]()
    if args.phase == "probe":  # importable here?
        print(json.dumps({"engine": eng.name, "ok": True, "torch": torch.__version__}))
        return 0
    run = save_phase(args, eng) if args.phase == "save" else load_phase(args, eng)
    print(json.dumps({"engine": eng.name, "phase": args.phase, **run}), flush=True)
    return 0 if run.get("bitwise_ok", True) else 3


if __name__ == "__main__":
    sys.exit(main())
