"""What an interpreter exit does with the saves still in flight: waits for each to commit
(rather than fail half-way), says which it waits for once the wait is noticeable, and logs
each async save that failed with nobody having seen its error.

Call order: the Checkpointer (api.py) calls ``track`` for each save it starts; the hook
registered here runs at exit before concurrent.futures stops accepting work and the save
threads (io/worker.py) stop: threading runs these hooks newest first, and io/worker.py
registers its own when imported, which this module's import makes happen first.
A forked child (a DataLoader worker, a multiprocessing Process) starts with an empty registry:
the parent's saves run on the parent's threads, never finish in the child, and its exit must
not wait for them.
Owns: the registry of saves in flight (weak: a finished save is not kept) and the exit's
messages. Does not own: the saves (save_session.py) or their errors' reporting
(HandleControl).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import weakref

import ckptio.io.worker  # noqa: F401  (its exit hook is registered before this module's)
from ckptio.saving.handle import HandleControl

__all__ = ["track"]

log = logging.getLogger("ckptio")
_SAY_AFTER_S = 2.0  # an exit waiting longer for saves in flight says so
_running: weakref.WeakSet[concurrent.futures.Future[None]] = weakref.WeakSet()
_controls: weakref.WeakSet[HandleControl] = weakref.WeakSet()


def track(running: concurrent.futures.Future[None], control: HandleControl) -> None:
    """A save started: the exit waits for ``running`` and reports ``control``'s error."""
    _running.add(running)
    _controls.add(control)


def _finish_saves_at_exit() -> None:
    if concurrent.futures.wait(list(_running), timeout=_SAY_AFTER_S).not_done:
        _say_waiting()
        concurrent.futures.wait(list(_running))
    _say_unwaited_errors()


def _say_waiting() -> None:
    """While saves are still in flight: their paths, so that an exit that waits (a slow or
    silent store) says why and how to stop waiting."""
    paths = [control.path for control in list(_controls) if not control.done()]
    if paths:
        log.warning("ckptio: exiting: waiting for %d save(s) in flight to be committed (%s%s); "
                    "an interrupt (Ctrl-C) exits now, and they are then not committed (the "
                    "checkpoints committed before stay)", len(paths), ", ".join(paths[:3]),
                    ", ..." if len(paths) > 3 else "")


def _say_unwaited_errors() -> None:
    """Once the saves in flight have finished: each async save that failed and that no
    wait(), close() or next save raised, logged as an error naming its path (else an exit
    after a failed last save would look like a successful one)."""
    for control in list(_controls):
        error = control.unreported_error()
        if error is not None:
            log.error("ckptio: the save to %s failed in the background and nothing waited for "
                      "it before exit, so it is not committed: %s: %s. Call handle.wait() or "
                      "close() before exiting to have such errors raised", control.path,
                      type(error).__name__, error)


def _forget_in_child() -> None:
    """After a fork, in the child: none of the parent's saves is this process's to wait for
    or to report."""
    _running.clear()
    _controls.clear()


os.register_at_fork(after_in_child=_forget_in_child)
threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]
