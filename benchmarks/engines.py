"""One timed durable save and one timed cold load per engine, in the calling process.

Owns: how each peer is driven at its best documented settings, what "durable" costs each of them
(os.sync() added inside the clock where an engine does not fsync), copying a loaded state into
existing tensors, and timing one phase with its peak extra RSS (VmHWM, reset through
/proc/self/clear_refs). Does not own: page-cache dropping (ceiling.py), the protocol and the
fresh processes (save_load.py), or the state (state.py).

Every engine is a pair save(state, path) -> None / load(path, dest) -> object, where ``path`` is
a directory that does not exist yet and ``dest`` is a destination built by
state.empty_destination; load fills ``dest`` in place and may return a report.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SaveFn = Callable[[Any, Path], None]
LoadFn = Callable[[Path, Any], object]


@dataclass(frozen=True)
class Engine:
    name: str
    save: SaveFn
    load: LoadFn
    note: str  # what "durable" means for it, printed under the results table
    modules: tuple[str, ...] = ()  # imported by prepare(), never inside the clock

    def prepare(self) -> None:
        """Import what the engine needs before anything is timed (DCP's import alone is 1.2 s)."""
        for module in self.modules:
            importlib.import_module(module)


# ---------------------------------------------------------------- copying into existing tensors


def merge_into(dest: Any, src: Any) -> Any:
    """Copy ``src`` into ``dest`` the way load_state_dict does: tensors in place (copy_), other
    leaves replaced in their dict or list. Returns what the parent should now hold."""
    if isinstance(dest, torch.Tensor) and isinstance(src, torch.Tensor):
        if dest is not src:
            with torch.no_grad():
                dest.copy_(src)
        return dest
    if isinstance(dest, dict) and isinstance(src, dict):
        for key, value in src.items():
            dest[key] = merge_into(dest[key], value) if key in dest else value
        return dest
    if isinstance(dest, list) and isinstance(src, list) and len(dest) == len(src):
        for i, value in enumerate(src):
            dest[i] = merge_into(dest[i], value)
        return dest
    if isinstance(dest, tuple) and isinstance(src, tuple) and len(dest) == len(src):
        return type(src)(merge_into(d, s) for d, s in zip(dest, src))  # type: ignore[call-arg]
    return src


# ---------------------------------------------------------------- torch.save


def torch_save_to(state: Any, path: Path) -> None:
    path.mkdir(parents=True)
    with open(path / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.sync()


def torch_load_into(path: Path, dest: Any) -> None:
    loaded = torch.load(path / "state.pt", mmap=False, weights_only=True)
    merge_into(dest, loaded)


# ---------------------------------------------------------------- torch.distributed.checkpoint


def _dcp_save(threads: int) -> SaveFn:
    def save(state: Any, path: Path) -> None:
        import torch.distributed.checkpoint as dcp  # imported already by Engine.prepare

        writer = dcp.FileSystemWriter(str(path), thread_count=threads, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
        os.sync()  # .metadata's rename and the directory: sync_files fsyncs only the files

    return save


def _dcp_load(path: Path, dest: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(dest, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)


# ---------------------------------------------------------------- TorchSnapshot


class DictStateful:
    """TorchSnapshot saves Stateful objects only; this wraps a plain state dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        merge_into(self.state, state)


def _snapshot_save(state: Any, path: Path) -> None:
    from torchsnapshot import Snapshot

    Snapshot.take(path=str(path), app_state={"state": DictStateful(state)})
    os.sync()  # take() writes through the page cache and never fsyncs


def _snapshot_load(path: Path, dest: Any) -> None:
    from torchsnapshot import Snapshot

    Snapshot(path=str(path)).restore(app_state={"state": DictStateful(dest)})


# ---------------------------------------------------------------- ckptio


def _ckptio_save(backend: str) -> SaveFn:
    def save(state: Any, path: Path) -> None:
        ckptio = importlib.import_module("ckptio")
        ckptio.save(state, str(path), options=ckptio_options(backend))
    return save


def _ckptio_load(backend: str) -> Callable[[Path, Any], object]:
    def load(path: Path, dest: Any) -> object:
        ckptio = importlib.import_module("ckptio")
        return ckptio.load(str(path), dest, options=ckptio_options(backend))
    return load


def ckptio_options(backend: str) -> Any:
    """Defaults (and CKPTIO_* env) with the backend fixed; no tuned profile, so runs compare
    the engines, not whatever `ckptio tune` stored on this machine."""
    ckptio = importlib.import_module("ckptio")
    return ckptio.Options.from_env(io_backend=backend, use_profile=False)


# ---------------------------------------------------------------- registry

# `import ckptio` is lazy (PEP 562): the modules behind ckptio.save/load are imported here,
# before the clock, as DCP's are
_CKPTIO_MODULES = ("ckptio", "ckptio.api", "ckptio.shared")

ENGINES: dict[str, Engine] = {
    "torch_save": Engine("torch_save", torch_save_to, torch_load_into,
                         "torch.save, fsync of the file and os.sync() inside the clock; "
                         "load = torch.load(mmap=False, weights_only=True) + copy_ into place"),
    **{f"dcp_t{k}": Engine(f"dcp_t{k}", _dcp_save(k), _dcp_load,
                           f"DCP save, FileSystemWriter(thread_count={k}, sync_files=True), "
                           "then os.sync() inside the clock (its directory entries), no "
                           "process group; load = dcp.load in place",
                           ("torch.distributed.checkpoint",))
       for k in (1, 2, 4)},
    "torchsnapshot": Engine("torchsnapshot", _snapshot_save, _snapshot_load,
                            "Snapshot.take + os.sync() inside the clock (take does not fsync); "
                            "load = Snapshot.restore in place", ("torchsnapshot",)),
    "ckptio": Engine("ckptio", _ckptio_save("auto"), _ckptio_load("auto"),
                     "ckptio.save (durable and committed when it returns); load = ckptio.load in "
                     "place; the default backend (\"auto\": io_uring where it works, else POSIX)",
                     _CKPTIO_MODULES),
    "ckptio_posix": Engine("ckptio_posix", _ckptio_save("posix"), _ckptio_load("posix"),
                           "ckptio as above through the POSIX thread-pool backend (the default "
                           "before issue 29 round six)", _CKPTIO_MODULES),
    "ckptio_uring": Engine("ckptio_uring", _ckptio_save("uring"), _ckptio_load("uring"),
                           "ckptio as above through the io_uring backend", _CKPTIO_MODULES),
}


def unavailable_reason(name: str) -> str | None:
    """None when ``name`` can run here, else why not."""
    if name not in ENGINES:
        return f"unknown engine {name!r}; known: {', '.join(ENGINES)}"
    if name == "torchsnapshot" and importlib.util.find_spec("torchsnapshot") is None:
        return "torchsnapshot is not installed"
    if name in ("ckptio", "ckptio_posix"):
        return _ckptio_unavailable()
    if name == "ckptio_uring":
        return _ckptio_unavailable() or importlib.import_module("ckptio.io").uring_unavailable_reason()
    return None


def _ckptio_unavailable() -> str | None:
    try:
        ckptio = importlib.import_module("ckptio")
    except (ImportError, SyntaxError, AttributeError, NameError, TypeError) as exc:
        return f"import ckptio failed: {type(exc).__name__}: {exc}"
    missing = [fn for fn in ("save", "load") if not callable(getattr(ckptio, fn, None))]
    return f"ckptio has no {', '.join(missing)}" if missing else None


def available() -> list[str]:
    return [name for name in ENGINES if unavailable_reason(name) is None]


# ---------------------------------------------------------------- one timed phase


@dataclass(frozen=True)
class Phase:
    seconds: float
    extra_rss_mib: float  # peak RSS during the phase minus RSS just before it
    peak_reset: bool  # False: VmHWM could not be reset, so the peak may predate the phase
    result: object


def timed_save(engine: Engine, state: Any, path: Path, idle: float, reset_peak: bool = True) -> Phase:
    return timed_phase(lambda: engine.save(state, path), idle, reset_peak)


def timed_load(engine: Engine, path: Path, dest: Any, idle: float) -> Phase:
    return timed_phase(lambda: engine.load(path, dest), idle)


def timed_phase(fn: Callable[[], object], idle: float, reset_peak: bool = True) -> Phase:
    """Release free heap, idle, then time ``fn`` and read the RSS peak it reached (since the
    previous reset, when ``reset_peak`` is False)."""
    gc.collect()
    release_free_heap()
    settle_disk()
    time.sleep(idle)
    before = status_kib("VmRSS")
    reset = reset_peak_rss() if reset_peak else True
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return Phase(seconds, (status_kib("VmHWM") - before) / 1024, reset, out)


def settle_disk() -> None:
    """Start every timed phase from a quiet disk: sync commits the journal, and with ext4's
    `discard` mount option (this VM's root) that waits for the discards of files an earlier
    worker deleted, which otherwise slow whichever run comes next."""
    os.sync()


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kib("VmHWM") <= status_kib("VmRSS") + 64


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc malloc_trim), so a phase's extra RSS is memory
    it needed, not a reuse of what the previous phase freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS+ may be understated by reused free heap
