"""The ranks of a save or load, and the few byte messages they exchange.

A ``Group`` is this process's rank, the number of ranks and four collectives on byte strings
(gather to the coordinator, scatter from it, broadcast from it, all-gather). ``Solo`` is one
process with no torch.distributed; ``TorchGroup`` runs over a gloo group of its own, made once
from the caller's process group (so metadata never goes through NCCL, and a save's background
thread never shares a communicator with the training loop).

Owns: choosing the group, and moving bytes (length first, then the padded bytes as a uint8
tensor: nothing is pickled). Does not own: what the bytes say (wire.py).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch

__all__ = ["COORDINATOR", "Group", "Solo", "TorchGroup", "current_group"]

COORDINATOR = 0


class Group(Protocol):
    rank: int
    size: int

    def gather(self, data: bytes) -> list[bytes] | None:
        """Every rank's bytes on the coordinator (in rank order); None elsewhere."""
        ...

    def scatter(self, parts: list[bytes] | None) -> bytes:
        """The coordinator passes one part per rank; every rank gets its own."""
        ...

    def broadcast(self, data: bytes | None) -> bytes:
        """The coordinator's bytes on every rank."""
        ...

    def all_gather(self, data: bytes) -> list[bytes]:
        ...


class Solo:
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def gather(self, data: bytes) -> list[bytes] | None:
        return [data]

    def scatter(self, parts: list[bytes] | None) -> bytes:
        assert parts is not None and len(parts) == 1  # internal: the coordinator always passes them
        return parts[0]

    def broadcast(self, data: bytes | None) -> bytes:
        assert data is not None  # internal
        return data

    def all_gather(self, data: bytes) -> list[bytes]:
        return [data]


class TorchGroup:
    """The ranks of a torch.distributed process group, over a private gloo group."""

    def __init__(self, group: Any, timeout: timedelta | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        ranks = dist.get_process_group_ranks(group)
        # Collective over the group's members only (use_local_synchronization): the first save
        # or load over this group, which every member calls anyway.
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                                    use_local_synchronization=True)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def _lengths(self, nbytes: int) -> list[int]:
        mine = torch.tensor([nbytes], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

    def gather(self, data: bytes) -> list[bytes] | None:
        lengths = self._lengths(len(data))
        padded = _padded(data, max(lengths))
        if self.rank != COORDINATOR:
            self._dist.gather(padded, None, group=self.group, group_dst=COORDINATOR)
            return None
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self._dist.gather(padded, out, group=self.group, group_dst=COORDINATOR)
        return [_bytes(t, n) for t, n in zip(out, lengths)]

    def scatter(self, parts: list[bytes] | None) -> bytes:
        if self.rank == COORDINATOR:
            assert parts is not None and len(parts) == self.size  # internal
            lengths = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        else:
            lengths = torch.zeros(self.size, dtype=torch.int64)
        self._dist.broadcast(lengths, group=self.group, group_src=COORDINATOR)
        width = int(lengths.max().item())
        mine = torch.empty(width, dtype=torch.uint8)
        chunks = [_padded(p, width) for p in parts] if self.rank == COORDINATOR and parts else None
        self._dist.scatter(mine, chunks, group=self.group, group_src=COORDINATOR)
        return _bytes(mine, int(lengths[self.rank].item()))

    def broadcast(self, data: bytes | None) -> bytes:
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._dist.broadcast(length, group=self.group, group_src=COORDINATOR)
        n = int(length.item())
        buf = _padded(data, n) if self.rank == COORDINATOR and data is not None else torch.empty(n, dtype=torch.uint8)
        self._dist.broadcast(buf, group=self.group, group_src=COORDINATOR)
        return _bytes(buf, n)

    def all_gather(self, data: bytes) -> list[bytes]:
        lengths = self._lengths(len(data))
        padded = _padded(data, max(lengths))
        out = [torch.empty_like(padded) for _ in range(self.size)]
        self._dist.all_gather(out, padded, group=self.group)
        return [_bytes(t, n) for t, n in zip(out, lengths)]


def _padded(data: bytes, width: int) -> torch.Tensor:
    out = torch.zeros(max(width, 1), dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].numpy().tobytes()


def current_group(process_group: Any = None) -> Any | None:
    """The torch process group a save or load runs over: the one given, else the default one
    when torch.distributed is initialised with more than one rank; None: a single process."""
    if process_group is not None:
        return process_group
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    group = torch.distributed.group.WORLD
    return group if torch.distributed.get_world_size(group) > 1 else None
