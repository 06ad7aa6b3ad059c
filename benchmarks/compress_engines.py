"""The engines of the compression benchmark: how each one saves a sequence of checkpoints of a
training run into one directory or prefix, loads one back, and what each checkpoint stores.

Owns: the engines (ckptio without compression, with ``Options.compression`` "auto" and a named
codec, ckptio deltas through ``Checkpointer.save(..., base=)`` and through
``CheckpointManager(delta=..., compression=...)``, DCP plain and with
its zstd stream extension, torch.save), why one cannot run here, a checkpoint's stored bytes (its
own files or objects only: a delta's base is not counted again) and, for ckptio, its logical and
stored bytes per tensor class read from its manifest (format version 4's ``stored`` / ``ref`` /
``xor`` fields, docs/FORMAT.md). Does not own: timing, cold caches, servers (compress.py),
the trajectory (compress_traj.py).

Every engine runs through the public API only (Options(compression=...), Checkpointer.save(...,
base=...), CheckpointManager(delta=..., compression=...), dcp.FileSystemWriter(...,
_extensions=...)).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.compress_traj import CLASSES, tensor_class
from benchmarks.engines import torch_load_into, torch_save_to

__all__ = ["ENGINES", "Engine", "Session", "class_bytes", "stored_bytes", "unavailable_reason"]

LOCAL, S3 = "local", "s3"


class Session:
    """One engine in one worker: saves checkpoints under any root (a directory or s3:// prefix)
    and loads them, reusing its pools and clients throughout (warmed up once)."""

    def path(self, root: str, step: int) -> str:
        return f"{root}/step-{step:08d}"

    def save(self, root: str, step: int, state: Any) -> str:
        raise NotImplementedError

    def load(self, path: str, dest: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Engine:
    name: str
    stores: tuple[str, ...]
    note: str
    session: Callable[[str], Session]  # (codec) -> Session
    ckptio: bool = True  # its manifests tell stored bytes per class


# ------------------------------------------------------------------------------ ckptio


def _options(compression: str = "off") -> Any:
    """Defaults (and CKPTIO_* env) without a tuned profile, as the other benchmarks, with
    ``Options.compression`` (absent before issue 28's engine: then only "off" runs)."""
    import ckptio

    extra = {"compression": compression} if compression != "off" else {}
    return ckptio.Options.from_env(use_profile=False, **extra)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


class CkptioSession(Session):
    def __init__(self, compression: str) -> None:
        import ckptio

        self.ck = ckptio.Checkpointer(_options(compression))

    def save(self, root: str, step: int, state: Any) -> str:
        path = self.path(root, step)
        self.ck.save(state, path)
        return path

    def load(self, path: str, dest: Any) -> None:
        self.ck.load(path, dest)

    def close(self) -> None:
        self.ck.close()


class BaseSession(CkptioSession):
    """Deltas through Checkpointer.save(base=): a sequence's first checkpoint is full, every
    later one a delta against it (what the manager does with full_every >= the sequence)."""

    def __init__(self, compression: str) -> None:
        super().__init__(compression)
        self.bases: dict[str, str] = {}

    def save(self, root: str, step: int, state: Any) -> str:
        path = self.path(root, step)
        self.ck.save(state, path, base=self.bases.get(root))
        self.bases.setdefault(root, path)
        return path


class ManagerSession(CkptioSession):
    """A CheckpointManager per root (its delta policy's defaults, every step kept), all on this
    session's Checkpointer, whose Options(compression=...) the managers use (a manager given a
    Checkpointer refuses its own compression=)."""

    def __init__(self, compression: str) -> None:
        super().__init__(compression)
        self.managers: dict[str, Any] = {}

    def manager(self, root: str) -> Any:
        import ckptio

        if root not in self.managers:
            self.managers[root] = ckptio.CheckpointManager(root, keep_last=None,
                                                           checkpointer=self.ck, delta=True)
        return self.managers[root]

    def path(self, root: str, step: int) -> str:
        return self.manager(root).path(step)

    def save(self, root: str, step: int, state: Any) -> str:
        self.manager(root).save(step, state, force=True)
        return self.path(root, step)

    def close(self) -> None:
        for m in self.managers.values():
            m.close()
        super().close()


# ------------------------------------------------------------------------------ peers


class DcpSession(Session):
    def __init__(self, zstd: bool) -> None:
        self.zstd = zstd

    def save(self, root: str, step: int, state: Any) -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard

        path = self.path(root, step)
        extensions = [ZStandard()] if self.zstd else None
        writer = dcp.FileSystemWriter(path, thread_count=2, sync_files=True,
                                      _extensions=extensions)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
        os.sync()  # .metadata's rename and the directory: sync_files fsyncs only the files
        return path

    def load(self, path: str, dest: Any) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(dest, storage_reader=dcp.FileSystemReader(path), no_dist=True)


class TorchSaveSession(Session):
    def save(self, root: str, step: int, state: Any) -> str:
        path = self.path(root, step)
        torch_save_to(state, Path(path))
        return path

    def load(self, path: str, dest: Any) -> None:
        torch_load_into(Path(path), dest)


ENGINES: dict[str, Engine] = {e.name: e for e in [
    Engine("ckptio_off", (LOCAL, S3), "ckptio.Checkpointer.save, no compression (full, "
           "uncompressed: the baseline)", lambda _c: CkptioSession("off")),
    Engine("ckptio_auto", (LOCAL, S3), "Options(compression=\"auto\"), no tuned profile (as "
           "every ckptio engine here)",
           lambda _c: CkptioSession("auto")),
    Engine("ckptio_codec", (LOCAL, S3), "Options(compression=CODEC): every chunk that shrinks",
           CkptioSession),
    Engine("ckptio_base", (LOCAL, S3), "Checkpointer(Options(compression=CODEC)).save(..., "
           "base=FIRST): later checkpoints are deltas against the sequence's first",
           BaseSession),
    Engine("ckptio_delta", (LOCAL, S3), "CheckpointManager(delta=True) on a Checkpointer with "
           "Options(compression=CODEC): its policy picks full bases and deltas", ManagerSession),
    Engine("dcp", (LOCAL,), "dcp.save, FileSystemWriter(thread_count=2, sync_files=True), then os.sync()",
           lambda _c: DcpSession(False), ckptio=False),
    Engine("dcp_zstd", (LOCAL,), "as dcp, with _extensions=[ZStandard()] (zstandard, level 3 "
           "default, one stream per file)", lambda _c: DcpSession(True), ckptio=False),
    Engine("torch_save", (LOCAL,), "torch.save + fsync; torch.load(weights_only=True) + copy_",
           lambda _c: TorchSaveSession(), ckptio=False),
]}


def unavailable_reason(name: str, store: str) -> str | None:
    """None when engine ``name`` runs on ``store`` here, else why not."""
    engine = ENGINES.get(name)
    if engine is None:
        return f"unknown engine {name!r}; known: {', '.join(ENGINES)}"
    if store not in engine.stores:
        return {"dcp": "DCP's S3 path needs s3fs (benchmarks/s3_setup.sh's peer venv)",
                "dcp_zstd": "DCP's S3 path needs s3fs (benchmarks/s3_setup.sh's peer venv)",
                "torch_save": "torch.save writes local files"}.get(name, "local only")
    if name == "dcp_zstd" and importlib.util.find_spec("zstandard") is None:
        return "DCP's ZStandard extension needs zstandard"
    if name in ("ckptio_auto", "ckptio_codec", "ckptio_base", "ckptio_delta"):
        return _ckptio_feature_missing(name)
    return None


def _ckptio_feature_missing(name: str) -> str | None:
    import dataclasses

    import ckptio

    if "compression" not in {f.name for f in dataclasses.fields(ckptio.Options)}:
        return "this ckptio has no Options.compression (issue 28's engine)"
    if importlib.util.find_spec("zstandard") is None:
        return "ckptio's codecs need zstandard (pip install 'ckptio[compress]')"
    if name == "ckptio_delta" and not _takes(ckptio.CheckpointManager.__init__, "delta"):
        return "this ckptio has no CheckpointManager(delta=) (issue 28's policy)"
    return None


# ------------------------------------------------------------------------------ bytes


def stored_bytes(path: str) -> int:
    """Bytes of the checkpoint's own files (local) or objects (s3://) under ``path``."""
    if path.startswith("s3://"):
        from ckptio.storage.s3.client import client
        from ckptio.storage.s3.settings import S3Settings

        bucket, _, prefix = path[5:].partition("/")
        c = client(S3Settings(endpoint_url=os.environ["AWS_ENDPOINT_URL"]))
        total = 0
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                Prefix=prefix + "/"):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def class_bytes(path: str) -> dict[str, dict[str, int]]:
    """Per tensor class: logical bytes, bytes stored in this checkpoint (a referenced entry: 0;
    a compressed or XOR entry: its ``stored.nbytes``), and how many entries were referenced,
    XOR-coded or compressed; from the manifest's raw JSON (the contract's field names)."""
    from ckptio.storage.select import store_for

    data = store_for(path, _options()).read_manifest()
    body = json.loads(data[data.index(b"\n") + 1:])
    out = {c: {"logical": 0, "stored": 0, "ref": 0, "xor": 0, "compressed": 0} for c in CLASSES}
    for entry in body["tensors"]:
        row = out[tensor_class(entry["key"])]
        row["logical"] += entry["nbytes"]
        stored = entry.get("stored")
        if "ref" in entry:
            row["ref"] += 1
        else:
            row["stored"] += stored["nbytes"] if stored else entry["nbytes"]
        row["xor"] += "xor" in entry
        row["compressed"] += bool(stored) and "ref" not in entry
    return {c: v for c, v in out.items() if v["logical"]}
