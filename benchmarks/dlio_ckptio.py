"""ckptio as a checkpoint engine of DLIO (MLPerf Storage's checkpointing workload).

DLIO loads an engine by name: ``checkpoint.checkpoint_mechanism_classname:
benchmarks.dlio_ckptio.CkptioCheckpointing`` (the repository root on PYTHONPATH). Its base class
(dlio_benchmark.checkpointing.base_checkpointing.BaseCheckpointing) builds each rank's state
(layer and optimizer tensors, shaped by the workload) and, per checkpoint, calls
``save_state(suffix, state, fsync)`` and later ``load_state(suffix, state)`` once per file that
rank owns; this module answers those two calls with ckptio.save / ckptio.load, one ckptio
checkpoint directory ``<checkpoint_folder>/<suffix>.ckptio`` per call (each MPI rank alone: DLIO
does not initialise torch.distributed). A save returns once its data files and manifest are
fsynced and committed, whatever ``fsync`` says; a load fills the tensors DLIO passes, in place
(the way a resuming job loads), with ckptio's default checksum verification.

Also here: TorchFsyncCheckpointing, DLIO's own torch.save engine with the fsync its workload
configs ask for (``checkpoint.fsync: True`` lands on an unused attribute in this DLIO, so its
engine never fsyncs; see docs/BENCH_DLIO.md).

Owns: the engine classes. Does not own: running DLIO (benchmarks/dlio_run.py), its venv
(benchmarks/dlio_setup.sh). Imports DLIO, so it runs only in that venv; ckptio never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from dlio_benchmark.checkpointing.base_checkpointing import BaseCheckpointing
from dlio_benchmark.checkpointing.pytorch_checkpointing import PyTorchCheckpointing

import ckptio

__all__ = ["CkptioCheckpointing", "TorchFsyncCheckpointing"]


class CkptioCheckpointing(PyTorchCheckpointing):
    """DLIO's torch engine (its tensor making, layouts and timing) writing through ckptio."""

    _instance: CkptioCheckpointing | None = None

    @classmethod
    def get_instance(cls) -> CkptioCheckpointing:
        """DLIO's factory asks the class for its one instance per process."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        BaseCheckpointing.__init__(self, "ckptio")

    def save_state(self, suffix: str, state: dict[str, Any], fsync: bool = False) -> None:
        """One ckptio checkpoint per DLIO file; durable on return (``fsync`` is moot)."""
        ckptio.save(state, self.get_name(suffix))

    def load_state(self, suffix: str, state: dict[str, Any]) -> None:
        """Read the checkpoint back into DLIO's own tensors (checksums verified)."""
        report = ckptio.load(self.get_name(suffix), state)
        self.logger.debug(f"ckptio loaded {self.get_name(suffix)}: {report}")


class TorchFsyncCheckpointing(PyTorchCheckpointing):
    """DLIO's torch.save engine, fsyncing each file as MLPerf Storage's rules require."""

    _instance: TorchFsyncCheckpointing | None = None

    @classmethod
    def get_instance(cls) -> TorchFsyncCheckpointing:
        """DLIO's factory asks the class for its one instance per process."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def save_state(self, suffix: str, state: dict[str, Any], fsync: bool = False) -> None:
        """DLIO's save_state with fsync on (the file only, as DLIO does; not its directory)."""
        with open(self.get_name(suffix), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
