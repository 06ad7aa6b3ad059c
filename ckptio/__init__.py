"""ckptio: fast, verified PyTorch checkpoints.

    ckptio.save(state, "ckpts/step-100")            # durable and committed when it returns
    report = ckptio.load("ckpts/step-100", state)   # in place; returns a LoadReport
    state = ckptio.load("ckpts/step-100")           # or fresh CPU tensors and values
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import Checkpointer, LoadReport, SaveHandle, SaveResult, async_save, load, save, verify
from .persist import Progress
from .errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    PickleRefusedError,
    StateMismatchError,
    StorageIOError,
    UnsupportedStateError,
)
from .options import Options

__all__ = [
    "Checkpointer", "LoadReport", "Options", "SaveResult", "AsyncSaveResult", "SaveHandle", "Progress",
    "async_save", "load", "save", "verify", "__version__",
    "CkptError", "CheckpointNotFoundError", "CorruptCheckpointError", "IncompleteCheckpointError",
    "ManifestError", "PickleRefusedError", "StateMismatchError", "StorageIOError",
    "UnsupportedStateError",
]

AsyncSaveResult = SaveResult  # the result of handle.wait(); the same fields as a save's
