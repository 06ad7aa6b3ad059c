"""Device->host copies of a save off the caller's stream: the events and side streams they use.

Call order: ``ready_events`` on the caller's thread when a save begins (save_session.py), before
the copies are queued anywhere else; then persist.SaveJob makes one ``side_streams`` per device,
makes them current while it captures (``on_streams``) and marks each full buffer with
``record_events``, which its hasher waits for before it reads the buffer.

Owns: which CUDA devices a save's sources are on, the side streams and events of its copies.
Does not own: the copies themselves, the buffers or their hand-off (persist.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["cuda_devices", "on_streams", "ready_events", "record_events", "side_streams"]


def ready_events(sources: dict[str, torch.Tensor]) -> list[Any]:
    """On the caller's thread: an event on its current stream of every device holding a source.

    Streams are per thread; the copies, made on another thread, wait for these so that work the
    caller queued before the save (the backward pass producing these values) comes first."""
    events = []
    for device in cuda_devices(sources):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


def side_streams(sources: dict[str, torch.Tensor], ready: Sequence[Any]) -> list[Any]:
    """One CUDA stream per device holding a source, for device->host copies (none on CPU)."""
    streams = [torch.cuda.Stream(device=device) for device in cuda_devices(sources)]
    for stream in streams:
        for event in ready:
            stream.wait_event(event)
    return streams


def cuda_devices(sources: dict[str, torch.Tensor]) -> list[torch.device]:
    """The CUDA devices holding a source, in index order; none without a look at each source
    where CUDA is not initialised in this process (then no tensor can be on a GPU)."""
    if not torch.cuda.is_initialized():
        return []
    return sorted({t.device for t in sources.values() if t.is_cuda}, key=lambda d: d.index or 0)


@contextlib.contextmanager
def on_streams(streams: list[Any]) -> Iterator[None]:
    """Make each side stream current on its device (copies from a device run on its stream)."""
    with contextlib.ExitStack() as stack:
        for stream in streams:
            stack.enter_context(torch.cuda.stream(stream))
        yield


def record_events(streams: list[Any]) -> list[Any]:
    """Events marking every copy queued so far; a buffer is read only after they complete."""
    events = []
    for stream in streams:
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events
