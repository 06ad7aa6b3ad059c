"""DLIO's s3torchconnector checkpoint engine, with its storage's listing able to see checkpoints.

MLPerf Storage's rules run the checkpoint workload as two DLIO runs, writes then (page cache
dropped) reads. The read run counts the checkpoints first, through DLIO's
S3PyTorchConnectorStorage.walk_node, whose list_objects lists the prefix
``s3://<bucket>/<folder>/`` as a key; S3Checkpoint stores its objects under the key
``<folder>/...``, so the count is 0 and the read run stops with "Number of checkpoints to be
read: ... is more than the number of checkpoints available". S3TorchCheckpointing is DLIO's
PyTorchS3Checkpointing unchanged (same S3Checkpoint writer and reader, same torch.save) except
that, when that listing finds nothing, the plain key prefix is listed too. Selected with
``checkpoint.checkpoint_mechanism_classname: benchmarks.dlio_s3torch.S3TorchCheckpointing``
and DLIO's S3 storage settings (benchmarks/dlio_run.py passes them).

Owns: that work-around. Imports DLIO and s3torchconnector: it runs only in DLIO's venv.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dlio_benchmark.checkpointing.pytorch_s3_checkpointing import PyTorchS3Checkpointing
from dlio_benchmark.storage.s3_torch_storage import S3PyTorchConnectorStorage

__all__ = ["S3TorchCheckpointing"]

Lister = Callable[[Any, str, "str | None"], list[str]]


def _keys_too(original: Lister) -> Lister:
    def list_objects(self: Any, bucket_name: str, prefix: str | None = None) -> list[str]:
        found = original(self, bucket_name, prefix)
        if found or not prefix:
            return found
        stream = self.s3_client.list_objects(bucket_name, prefix.lstrip("/") + "/")
        return [info.key for page in stream for info in page.object_info]
    list_objects.patched = True  # type: ignore[attr-defined]
    return list_objects


class S3TorchCheckpointing(PyTorchS3Checkpointing):
    """PyTorchS3Checkpointing whose read run finds the checkpoints its write run stored."""

    _instance: S3TorchCheckpointing | None = None

    @classmethod
    def get_instance(cls) -> S3TorchCheckpointing:
        """DLIO's factory asks the class for its one instance per process."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        lister = S3PyTorchConnectorStorage.list_objects
        if not getattr(lister, "patched", False):
            S3PyTorchConnectorStorage.list_objects = _keys_too(lister)  # type: ignore[method-assign]
        super().__init__()
