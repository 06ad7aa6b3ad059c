"""The loop benchmark's peers and floor, each behind one shape: ``start(step, state)`` on the
training thread after a step, ``guard()`` around the optimizer step (a lazy engine's lock),
``close()`` at the end (docs/BENCH_LOOP.md).

Owns: NVRx's local checkpoints, Meta's torch_checkpointing (PyPI ``torch-checkpointing``,
installed with ``--no-deps`` so torch stays; its CPU configuration from its troubleshooting
docs: no pinned memory; buffered writes, because its O_DIRECT writes of small items fail on
ext4 with EINVAL), and the memcpy floor (one copy of the state per save on a helper thread).
Does not own: the loop, the timing, ckptio's and DCP's savers (benchmarks/tiers.py,
train_engines.py).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any


class NvrxSaver:
    """NVRx LocalCheckpointManager, sync, on a 1-rank gloo group; its tensor-aware state dict
    asserts CUDA tensors, so a subclass lets CPU tensors through (see docs/BENCH_TIERS.md)."""

    def __init__(self, root: Path) -> None:
        import torch.distributed as dist
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
            BasicTensorAwareStateDict)
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager)

        from benchmarks.train_engines import free_port

        class CpuStateDict(BasicTensorAwareStateDict):  # type: ignore[misc]
            def __init__(self, state_dict: dict[str, Any]) -> None:
                self.state_dict, self._is_hollow = state_dict, False

            def restore_tensor_device(self, non_blocking: bool = True) -> None:
                pass

        # pickled by reference inside each checkpoint: a module-level name
        CpuStateDict.__qualname__ = CpuStateDict.__name__ = "CpuStateDict"
        globals()["CpuStateDict"] = CpuStateDict
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
        self.state_type = CpuStateDict
        self.manager = LocalCheckpointManager(str(root), session_id="bench")

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def start(self, step: int, state: dict[str, Any]) -> None:
        self.manager.save(self.state_type(state), iteration=step, is_async=False)

    def close(self) -> dict[str, Any]:
        return {}


class TorchCheckpointingSaver:
    """torch_checkpointing's async CheckpointManager: staging into shared memory on its thread,
    a writer subprocess; ``guard()`` is its ``lock()`` (the optimizer step waits while a capture
    runs). Each step into ``root/step-N``; as it keeps no checkpoints by itself, the directory
    of the step ``keep`` saves back is removed once a later write has finished (its save()
    waits for the previous write). Its files are not fsynced (it has no fsync)."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        config = CheckpointManager.Config.with_async_save()
        config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        self.manager = config.build()
        self.root, self.keep = root, keep
        self.steps: list[int] = []
        self.future: Any = None
        self.written: list[float] = []  # seconds from each save call to its future's end

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return self.manager.lock()

    def start(self, step: int, state: dict[str, Any]) -> None:
        import time

        began = time.perf_counter()
        self.future = self.manager.save(str(self.root / f"step-{step}"), state)
        self.future.add_done_callback(
            lambda _: self.written.append(time.perf_counter() - began))
        self.steps.append(step)
        if len(self.steps) > self.keep + 1:  # the previous write is done: drop the oldest
            shutil.rmtree(self.root / f"step-{self.steps.pop(0)}", ignore_errors=True)

    def close(self) -> dict[str, Any]:
        import time

        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()
        self.manager.close()
        import statistics

        return {"close_s": time.perf_counter() - t0,  # written, not fsynced: it has no fsync
                "tier0_durable_s": statistics.median(self.written) if self.written else None}


class FloorSaver:
    """The floor: one memcpy of every tensor of the state per save, on a helper thread
    (benchmarks/train_engines.FloorSaver with copy only); no format, nothing loadable."""

    def __init__(self, optimizer: Any) -> None:
        from benchmarks.train_engines import Context, FloorSaver as Copy

        self.copy = Copy(Context(optimizer, 0), copy=True, write=False)
        self.pending: Any = None

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def start(self, step: int, state: dict[str, Any]) -> None:
        if self.pending is not None and self.pending.durable is not None:
            self.pending.durable()
        self.pending = self.copy.start(state, Path("/nonexistent"))

    def close(self) -> dict[str, Any]:
        if self.pending is not None and self.pending.durable is not None:
            self.pending.durable()
        self.copy.close()
        return {}
