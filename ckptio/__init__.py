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

__version__ = "0.1.0"

from ckptio.api import Checkpointer, LoadReport, SaveHandle, SaveResult
from ckptio.shared import async_save, load, save, verify
from ckptio.saving.persist import Progress
from ckptio.errors import (CheckpointLockedError, CheckpointNotFoundError, CkptError, CorruptCheckpointError, IncompleteCheckpointError, ManifestError, PickleRefusedError, StateMismatchError, RankFailedError, StorageIOError, UnsupportedPathError, UnsupportedStateError)
from ckptio.options import Options
from ckptio.rng import RNGState
from ckptio.manager import CheckpointManager
from ckptio.export import export_hf
from ckptio.planning.sharding import FlatShard, TensorShard

if TYPE_CHECKING:
    from ckptio.dcp.reader import DcpReader
    from ckptio.dcp.writer import DcpWriter

__all__ = [
    "Checkpointer", "LoadReport", "Options", "SaveResult", "AsyncSaveResult", "SaveHandle", "Progress",
    "async_save", "load", "save", "verify", "__version__", "TensorShard", "FlatShard", "RNGState", "CheckpointManager",
    "export_hf",
    "CkptError", "CheckpointLockedError", "CheckpointNotFoundError", "CorruptCheckpointError", "IncompleteCheckpointError",
    "ManifestError", "PickleRefusedError", "RankFailedError", "StateMismatchError", "StorageIOError",
    "UnsupportedStateError", "UnsupportedPathError", "DcpReader", "DcpWriter",
]

AsyncSaveResult = SaveResult  # the result of handle.wait(); the same fields as a save's



def __getattr__(name: str) -> Any:
    """``ckptio.DcpReader`` / ``ckptio.DcpWriter`` on first use: they import
    torch.distributed.checkpoint (about 1 s), which ``import ckptio`` does not pay for (PEP 562)."""
    if name in ("DcpReader", "DcpWriter"):
        from ckptio import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'ckptio' has no attribute {name!r}")
