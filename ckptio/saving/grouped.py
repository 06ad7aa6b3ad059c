"""A capture's small host tensors copied with one call per dtype, not one per tensor.

Owns: ``Groups``, which a capture window (capture_window.Window) into the staging pool fills
with the small host tensors its runs of memmoves refuse (a strided or conjugate view, an
inference tensor: Window.put_run), as (destination view in a pool buffer, source) pairs, and
empties with one ``torch._foreach_copy_`` per dtype before the buffer's bytes are read (hand-off, a lazy save's
eager boundary). The copy has ``Tensor.copy_``'s meaning (strides, conjugate and negative
bits, inference tensors: the values in row-major order), as the per-tensor path's. Only plain
host tensors up to GROUP_MAX_NBYTES join (below torch's grain for splitting a copy across
threads, so the copy stays on the caller's thread); larger ones, subclasses and device tensors
keep the per-tensor path. Does not own: the buffers, the placement of bytes or the device
copies (capture_window.py, persist.py)."""

from __future__ import annotations

import torch

__all__ = ["GROUP_MAX_NBYTES", "Groups"]

GROUP_MAX_NBYTES = 1 << 15  # a host tensor up to this many bytes joins its dtype's group
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


class Groups:
    """Pending copies of one window, by dtype; ``flush`` makes them, one call per dtype."""

    def __init__(self) -> None:
        self._pending: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @staticmethod
    def takes(source: torch.Tensor, dtype: torch.dtype, nbytes: int) -> bool:
        """Whether ``source`` joins a group: a plain host tensor of ``dtype``, at most
        GROUP_MAX_NBYTES."""
        return (nbytes <= GROUP_MAX_NBYTES and type(source) in _PLAIN and source.is_cpu
                and source.dtype is dtype)

    def add(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``destination`` (same shape and dtype) at the next flush."""
        pending = self._pending.get(source.dtype)
        if pending is None:
            pending = self._pending[source.dtype] = ([], [])
        pending[0].append(destination)
        pending[1].append(source)

    def flush(self) -> None:
        """Every pending copy made: one ``torch._foreach_copy_`` per dtype."""
        while self._pending:
            destinations, sources = self._pending.popitem()[1]
            torch._foreach_copy_(destinations, sources)

    def drop(self) -> None:
        """Forget the pending copies (the window's buffer is abandoned)."""
        self._pending.clear()
