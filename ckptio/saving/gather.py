"""Device->host capture of many small device tensors in a few copies: gathered on the device.

A state holds hundreds of small device tensors (norms, biases, their optimizer moments); one
device->host copy each costs a launch and a small transfer apiece. ``DeviceGather`` collects
small, contiguous device sources bound for consecutive bytes of one host buffer, then, on
``flush``, zeroes a device scratch span, copies every source into its place in that span with
one ``torch._foreach_copy_`` (a multi-tensor kernel on the device) and moves the span to the
host buffer in one non_blocking copy on the current (side) stream. The span's gaps are zeros,
as the host buffer's padding would be.

Call order (persist.py's _Window): ``add`` for each eligible source; ``flush`` before any other
bytes go into the same buffer, before the buffer is handed off, and at the window's end;
``drop`` after a failure. Owns: the scratch (one per device, reused by the job's flushes, safe
to reuse because flushes are ordered on one stream). Does not own: the host buffer, the streams
or their synchronisation (persist.py).
Written here, not taken from a library: torch gathers tensors into one buffer only by
concatenation, which cannot place them at the layout's aligned offsets.
"""

from __future__ import annotations

import torch

from ckptio.io.stage import Buffer

__all__ = ["GATHER_MAX_NBYTES", "GATHER_SPAN_NBYTES", "DeviceGather"]

GATHER_MAX_NBYTES = 1 << 20  # a device source up to this is gathered; 0 turns gathering off
GATHER_SPAN_NBYTES = 32 << 20  # at most this many bytes of one host buffer per gathered copy


class DeviceGather:
    """Pending small device sources of one host buffer, copied out together by ``flush``."""

    def __init__(self) -> None:
        self._buffer: Buffer | None = None
        self._device: torch.device | None = None
        self._at: list[int] = []
        self._nbytes: list[int] = []
        self._sources: list[torch.Tensor] = []
        self._dtypes: list[torch.dtype] = []
        self._scratch: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def eligible(source: torch.Tensor, nbytes: int) -> bool:
        return (source.is_cuda and 0 < nbytes <= GATHER_MAX_NBYTES and source.is_contiguous()
                and not source.is_conj() and not source.is_neg())

    def add(self, buffer: Buffer, at: int, nbytes: int, source: torch.Tensor,
            dtype: torch.dtype) -> None:
        """``source`` into bytes [at, at + nbytes) of ``buffer`` at the next flush."""
        if self._at and (buffer is not self._buffer or source.device != self._device
                         or at + nbytes - self._at[0] > GATHER_SPAN_NBYTES):
            self.flush()
        self._buffer, self._device = buffer, source.device
        self._at.append(at)
        self._nbytes.append(nbytes)
        self._sources.append(source)
        self._dtypes.append(dtype)

    def flush(self) -> None:
        """Queue the gathered copies on the current stream; nothing pending afterwards."""
        if not self._at:
            return
        assert self._buffer is not None and self._device is not None  # set by add
        lo, hi = self._at[0], self._at[-1] + self._nbytes[-1]
        span = self._span(self._device, hi - lo)
        span.zero_()
        targets = [span[at - lo:at - lo + n].view(dtype).view(s.shape)
                   for at, n, s, dtype in zip(self._at, self._nbytes, self._sources, self._dtypes)]
        torch._foreach_copy_(targets, self._sources)
        self._buffer.data[lo:hi].copy_(span, non_blocking=True)
        self.drop()

    def drop(self) -> None:
        """Forget what is pending (after a failure: nothing was queued for it)."""
        self._buffer, self._device = None, None
        self._at, self._nbytes, self._sources, self._dtypes = [], [], [], []

    def _span(self, device: torch.device, nbytes: int) -> torch.Tensor:
        scratch = self._scratch.get(device)
        if scratch is None or scratch.numel() < nbytes:
            scratch = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
            self._scratch[device] = scratch
        return scratch[:nbytes]
