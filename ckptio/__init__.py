"""ckptio: fast, verified PyTorch checkpoints.

    ckptio.save(state, "ckpts/step-100")            # durable and committed when it returns
    report = ckptio.load("ckpts/step-100", state)   # in place; returns a LoadReport
    state = ckptio.load("ckpts/step-100")           # or fresh CPU tensors and values

With torch.distributed initialised, every rank calls save and load together (DTensor / FSDP2 /
tensor-parallel state, or ckptio.TensorShard / FlatShard); a load reshards into any layout.

The public surface is ``__all__`` below and nothing else: the sub-packages (format, planning, io,
storage, distributed, saving, loading, tuning, testing, demo) are internal layers whose modules
may change without notice (tests/test_layers.py pins this list and the layer order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptio.version import __version__

if TYPE_CHECKING:  # bound on first use by __getattr__ below (type checkers see them here)
    from ckptio.api import AsyncSaveResult, Checkpointer, LoadReport, SaveHandle, SaveResult
    from ckptio.dcp.reader import DcpReader
    from ckptio.dcp.writer import DcpWriter
    from ckptio.errors import (
        CheckpointLockedError,
        CheckpointNotFoundError,
        CkptError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
        ManifestError,
        PickleRefusedError,
        RankFailedError,
        SaveTimeoutError,
        StateMismatchError,
        StorageIOError,
        UnsupportedPathError,
        UnsupportedStateError,
    )
    from ckptio.export import export_hf
    from ckptio.managing.manager import CheckpointManager
    from ckptio.managing.tier import Tier
    from ckptio.optim import OptimizerState
    from ckptio.options import Options
    from ckptio.planning.sharding import FlatShard, TensorShard
    from ckptio.policies import (
        AnyOf,
        DeltaBasePolicy,
        DeltaPolicy,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepLatest,
        KeepRecent,
        RetentionPolicy,
        SaveEvery,
        SaveMoment,
        SaveOnPreemption,
        SavePolicy,
        StepInfo,
    )
    from ckptio.redundancy.redundancy import Parity, Partners
    from ckptio.rng import RNGState
    from ckptio.saving.persist import Progress
    from ckptio.shared import async_save, load, save, verify
    from ckptio.stepmeta import read_metadata
    from ckptio.storage.gcs.gcs_settings import GcsSettings
    from ckptio.storage.s3.settings import S3Settings
    from ckptio.storage.select import register_store, settings_for

__all__ = [
    "AnyOf",
    "AsyncSaveResult",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CkptError",
    "CorruptCheckpointError",
    "DcpReader",
    "DcpWriter",
    "DeltaBasePolicy",
    "DeltaPolicy",
    "FlatShard",
    "IncompleteCheckpointError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "KeepRecent",
    "LoadReport",
    "ManifestError",
    "OptimizerState",
    "Options",
    "Parity",
    "Partners",
    "PickleRefusedError",
    "Progress",
    "RNGState",
    "RankFailedError",
    "RetentionPolicy",
    "S3Settings",
    "GcsSettings",
    "SaveTimeoutError",
    "SaveEvery",
    "SaveHandle",
    "SaveMoment",
    "SaveOnPreemption",
    "SavePolicy",
    "SaveResult",
    "StateMismatchError",
    "StepInfo",
    "StorageIOError",
    "TensorShard",
    "Tier",
    "UnsupportedPathError",
    "UnsupportedStateError",
    "__version__",
    "async_save",
    "export_hf",
    "load",
    "read_metadata",
    "register_store",
    "save",
    "settings_for",
    "verify",
]

# Where each public name lives. Importing ``ckptio`` imports none of them (nor torch): the
# ``ckptio`` command reads manifests torch-free; the first use of a name imports its module.
_HOME = {
    "Checkpointer": "ckptio.api", "LoadReport": "ckptio.api", "SaveHandle": "ckptio.api",
    "SaveResult": "ckptio.api", "AsyncSaveResult": "ckptio.api",
    "async_save": "ckptio.shared", "load": "ckptio.shared", "save": "ckptio.shared",
    "verify": "ckptio.shared", "Progress": "ckptio.saving.persist", "Options": "ckptio.options",
    "RNGState": "ckptio.rng", "OptimizerState": "ckptio.optim",
    "CheckpointManager": "ckptio.managing.manager",
    "FlatShard": "ckptio.planning.sharding", "TensorShard": "ckptio.planning.sharding",
    "DcpReader": "ckptio.dcp.reader", "DcpWriter": "ckptio.dcp.writer",
    "export_hf": "ckptio.export", "register_store": "ckptio.storage.select",
    "settings_for": "ckptio.storage.select", "S3Settings": "ckptio.storage.s3.settings",
    "GcsSettings": "ckptio.storage.gcs.gcs_settings",
    "Tier": "ckptio.managing.tier", "Partners": "ckptio.redundancy.redundancy",
    "Parity": "ckptio.redundancy.redundancy", "read_metadata": "ckptio.stepmeta",
    **{name: "ckptio.policies" for name in (
        "AnyOf", "DeltaBasePolicy", "DeltaPolicy", "KeepAll", "KeepBest", "KeepEvery",
        "KeepLatest", "KeepRecent", "RetentionPolicy", "SaveEvery", "SaveMoment",
        "SaveOnPreemption", "SavePolicy", "StepInfo")},
    **{name: "ckptio.errors" for name in (
        "CkptError", "CheckpointLockedError", "CheckpointNotFoundError", "CorruptCheckpointError",
        "IncompleteCheckpointError", "ManifestError", "PickleRefusedError", "RankFailedError",
        "SaveTimeoutError", "StateMismatchError", "StorageIOError", "UnsupportedPathError",
        "UnsupportedStateError")},
}


def __getattr__(name: str) -> Any:
    """PEP 562: a public name, imported from its module on first access and kept here. The
    collector is paused meanwhile: the import makes only module-level objects, which live on,
    and each collection it would trigger walks the whole heap (a fresh process's torch), a
    visible part of a restarted job's first CheckpointManager or load."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ckptio' has no attribute {name!r}")
    import importlib

    from ckptio.format.gcpause import paused

    with paused():
        module = importlib.import_module(home)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

