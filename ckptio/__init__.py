"""ckptio: fast, verified PyTorch checkpoints.

    ckptio.save(state, "ckpts/step-100")            # durable and committed when it returns
    report = ckptio.load("ckpts/step-100", state)   # in place; returns a LoadReport
    state = ckptio.load("ckpts/step-100")           # or fresh CPU tensors and values

With torch.distributed initialised, every rank calls save and load together (DTensor / FSDP2 /
tensor-parallel state, or ckptio.TensorShard / FlatShard); a load reshards into any layout.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import Checkpointer, LoadReport, SaveHandle, SaveResult
from .shared import async_save, load, save, verify
from .persist import Progress
from .errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    PickleRefusedError,
    StateMismatchError,
    RankFailedError,
    StorageIOError,
    UnsupportedPathError,
    UnsupportedStateError,
)
from .options import Options
from .rng import RNGState
from .manager import CheckpointManager
from .sharding import FlatShard, TensorShard

__all__ = [
    "Checkpointer", "LoadReport", "Options", "SaveResult", "AsyncSaveResult", "SaveHandle", "Progress",
    "async_save", "load", "save", "verify", "__version__", "TensorShard", "FlatShard", "RNGState", "CheckpointManager",
    "CkptError", "CheckpointLockedError", "CheckpointNotFoundError", "CorruptCheckpointError", "IncompleteCheckpointError",
    "ManifestError", "PickleRefusedError", "RankFailedError", "StateMismatchError", "StorageIOError",
    "UnsupportedStateError", "UnsupportedPathError",
]

AsyncSaveResult = SaveResult  # the result of handle.wait(); the same fields as a save's

