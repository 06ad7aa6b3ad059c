"""What a caller holds while a save runs in the background (SaveHandle, SaveResult), and the
controller its save drives it through (HandleControl), with the optimizer pre-hooks of a lazy save.

Call order: the save session (save_session.py) makes one HandleControl per save and hands its
``handle`` to the caller; the session's threads move the save through it (planned -> staged ->
done or failed); the caller's SaveHandle only reads from it; the Checkpointer (api.py) keeps the
control of the save in flight to settle it before the next save.

Owns: that state machine, timings (blocked, capture, persist, total), reporting a background
error exactly once (on wait(), or else on the next save), and the hooks that make an optimizer
step wait until a lazy capture has finished (and which tensors, like the optimizers' own, a
lazy capture copies last: after_step_tensors, lazy_order). Does not own: the save's steps
(save_session.py) or its bytes (persist.py).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from typing import Any

import torch

from ckptio.errors import CkptError, SaveTimeoutError, seconds_to_wait
from ckptio.format.types import WriteItem
from ckptio.planning.sharding import local_tensor
from ckptio.saving.handover import Handover
from ckptio.saving.persist import Progress
from ckptio.io.stall import Activity

__all__ = ["HandleControl", "SaveHandle", "SaveResult", "after_step_tensors", "check_unchanged",
           "lazy_order", "lazy_versions", "skipped_handle"]


@dataclass(frozen=True)
class SaveResult:
    """A finished save. ``seconds`` is the whole save; the rest split it for async saves:
    blocked_s: time the caller's thread waited (inside the save call and in optimizer hooks);
    capture_s: planning until every byte was copied out of the state; persist_s: from then
    until durable and committed. ``skipped``: an async save not taken (another was running)."""

    path: str
    nbytes: int  # tensor bytes written (aliases and inline values not counted)
    files: tuple[str, ...]
    seconds: float
    blocked_s: float = 0.0
    capture_s: float = 0.0
    persist_s: float = 0.0
    skipped: bool = False

    @property
    def total_s(self) -> float:
        return self.seconds


@dataclass
class _Timings:
    started: float
    staged: float | None = None
    blocked: float = 0.0


class SaveHandle:
    """A save in flight, as ``async_save`` returns it.

    ``wait(timeout=None)``: block until it is durable and committed; returns its SaveResult or
    raises what went wrong (once); SaveTimeoutError after ``timeout`` seconds, naming the rank
    and the file the save waits for (it goes on: wait again). ``done()``: committed or failed.
    ``staged()``: every byte has been copied out of the state, which may change again.
    ``progress()``: bytes staged and written so far. ``path``: where it saves. The save drives
    it through its HandleControl.
    """

    def __init__(self, control: HandleControl) -> None:
        self.path = control.path
        self._control = control

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._control.done()

    def staged(self) -> bool:
        """True once every byte has been copied out of the state (the state may change)."""
        return self._control.staged()

    def progress(self) -> Progress:
        return self._control.progress

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until durable and committed; the background error, if any, is raised here.
        SaveTimeoutError after ``timeout`` seconds (the save goes on). Safe from any thread."""
        return self._control.wait(seconds_to_wait("SaveHandle.wait", timeout))


class HandleControl:
    """One save's state, owned by its session: the save's threads set it through the methods
    below, the caller's SaveHandle (``handle``) and the Checkpointer read it. Thread-safe."""

    def __init__(self, path: str, progress: Progress, files: tuple[str, ...],
                 started: float, activity: Activity | None = None) -> None:
        self.path, self.progress, self._files = path, progress, files
        self.activity = activity or Activity(path, 0, 0.0)  # its I/O calls (stall.py)
        self._times = _Timings(started)
        self._eager = threading.Event()  # what must be captured before the call returns
        self._staged = threading.Event()
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._hooks: list[Any] = []
        self._hooks_thread: int | None = None  # the thread that may remove them (the trainer's)
        self._hooks_pid = 0  # the process whose capture they wait for
        self._lock = threading.Lock()
        self._handover = Handover(path)  # an eager capture, to the caller's thread
        self._returned = threading.Event()

    @property
    def handle(self) -> SaveHandle:
        """The caller's view of this save (made on each use: holding none keeps a finished
        save from being a cycle that only the garbage collector frees)."""
        return SaveHandle(self)

    # ---------------------------------------------------------------- read by the handle

    def done(self) -> bool:
        return self._done.is_set()

    def staged(self) -> bool:
        return self._staged.is_set()

    def wait(self, timeout: float | None) -> SaveResult:
        """SaveHandle.wait(): the result, or the error (then counted as reported)."""
        if not self._done.wait(timeout):
            raise self.timed_out(timeout)
        self.remove_hooks()
        with self._lock:
            self._reported = True
        if self._error is not None:
            raise self._error
        assert self._result is not None  # internal: _done is set only with a result or an error
        # blocked_s read now: an optimizer hook on this (training) thread has added its wait
        return dataclasses.replace(self._result, blocked_s=self._times.blocked)

    def timed_out(self, timeout: float | None) -> SaveTimeoutError:
        """What a wait for this save that gave up after ``timeout`` seconds raises."""
        return SaveTimeoutError(
            f"the save to {self.path} did not finish within {timeout} s: "
            f"{self.activity.describe()}. It goes on in the background (a call in the kernel "
            "cannot be cancelled): wait again, or kill the process (SIGKILL: a normal exit "
            "waits for the save to finish); nothing partial is committed either way. "
            "Check the storage (dmesg, the network filesystem's server)")

    # ---------------------------------------------------------------- for the Checkpointer

    def unreported_error(self) -> BaseException | None:
        """The error of a finished save nobody has waited for (then it counts as reported).
        A save its caller's interrupt abandoned has none: the caller has the interrupt, and a
        save made after it (an emergency save on Ctrl-C) goes ahead."""
        with self._lock:
            if self._error is None or self._reported or not self._done.is_set() or \
                    self._handover.abandoned:
                return None
            self._reported = True
            return self._error

    def abandoned(self) -> bool:
        """Whether the caller's interrupt abandoned this save (it waits for nothing more)."""
        return self._handover.abandoned

    def skip(self) -> None:
        """An async save not taken (if_busy='skip'): done at once, with a skipped result."""
        self._result = SaveResult(self.path, 0, (), 0.0, skipped=True)
        for event in (self._eager, self._staged, self._done):
            event.set()

    # ---------------------------------------------------------------- for the save's threads

    def block_until_captured(self, *, lazy: bool) -> None:
        """The caller's wait inside async_save: for everything (eager) or the part no optimizer
        owns (lazy). An eager capture runs here, on the caller's thread, handed over by the
        save's thread (handover.py says why)."""
        if lazy:
            self._eager.wait()
        else:
            if self._handover.take():
                self.captured()  # before returning to the caller: staged() is true once it has
        self._times.blocked += time.perf_counter() - self._times.started

    def run_on_caller(self, capture: Callable[[], None]) -> None:
        """From the save's thread: have the caller (waiting in async_save) run ``capture``;
        returns once it has, raises what it raised (CkptError if the caller was interrupted)."""
        self._handover.give(capture)

    def mark_returned(self) -> None:
        self._returned.set()

    def wait_returned(self) -> None:
        """A lazy save's thread starts its Python-heavy work only once async_save has returned
        (it would take the GIL from the caller's last steps for no gain)."""
        self._returned.wait()

    def eager_captured(self) -> None:
        self._eager.set()

    def captured(self) -> None:
        if self._times.staged is None:
            self._times.staged = time.perf_counter()
        self._eager.set()
        self._staged.set()

    def files_written(self, files: tuple[str, ...]) -> None:
        """The data files a packed save wrote (named as its frames came out: saving/packing.py)."""
        self._files = files

    def finished(self, nbytes: int, error: BaseException | None = None) -> None:
        end = time.perf_counter()
        if error is None:
            start, staged = self._times.started, self._times.staged or end
            self._result = SaveResult(self.path, nbytes, self._files, end - start,
                                      self._times.blocked, staged - start, end - staged)
        self._error = error
        self._eager.set()
        self._staged.set()
        self._handover.close()
        self.activity.finish()
        self._done.set()

    # ---------------------------------------------------------------- lazy saves

    def hook_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make each optimizer's next step wait until the capture has finished."""
        self._hooks_thread = threading.get_ident()
        self._hooks_pid = os.getpid()  # a forked child's step waits for no capture of ours
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self._staged.is_set() or os.getpid() != self._hooks_pid:
            return
        began = time.perf_counter()
        self._staged.wait()
        self._times.blocked += time.perf_counter() - began

    def remove_hooks(self) -> bool:
        """Only from the thread that registered them (wait() there, or the next save): torch
        iterates the hook dict during step(), so hooks are never removed from another thread or
        from inside a hook. Elsewhere they stay (each returns at once): -> False."""
        if self._hooks and threading.get_ident() != self._hooks_thread:
            return False
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()
        return True


def skipped_handle(path: str) -> SaveHandle:
    """The handle of an async save not taken (if_busy='skip'), done at once."""
    control = HandleControl(path, Progress(0), (), time.perf_counter())
    control.skip()
    return control.handle


def optimizer_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage addresses of every tensor an optimizer's step changes: its parameters and state."""
    storages: set[int] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            storages.update(_storages(group["params"]))
        values = list(chain.from_iterable(map(_VALUES, optimizer.state.values())))
        storages.update(_storages(list(compress(values, map(isinstance, values,
                                                            repeat(torch.Tensor))))))
    return storages


def _storages(ts: Sequence[torch.Tensor]) -> list[int]:
    """_storage of each of ``ts``: by one ``map`` where they are all plain tensors."""
    if (list(map(_PLAIN.__contains__, map(type, ts))).count(True) != len(ts)
            or any(map(_DICT, ts))):
        return [_storage(t) for t in ts]
    return list(map(_DATA_PTR, map(_UNTYPED_STORAGE, ts)))


def _storage(t: torch.Tensor) -> int:
    """The address of the memory holding ``t``'s bytes (a DTensor's: its local shard's)."""
    if type(t) not in _PLAIN or t.__dict__:  # local_tensor's own first case, inline
        t = local_tensor(t)
    return t.untyped_storage().data_ptr()


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # their own storage: no local_tensor
_DICT = operator.attrgetter("__dict__")
_KEY = operator.attrgetter("key")
_DATA_PTR = operator.methodcaller("data_ptr")
_UNTYPED_STORAGE = operator.methodcaller("untyped_storage")
_VALUES = operator.methodcaller("values")  # of each parameter's state (a dict)
_VERSION = operator.attrgetter("_version")  # torch's version counter (tests/structure.py)
_IS_INFERENCE = operator.methodcaller("is_inference")


def lazy_order(items: Sequence[WriteItem], sources: dict[str, torch.Tensor],
                optimizers: Sequence[torch.optim.Optimizer],
                after_step: Sequence[torch.Tensor] = ()) -> tuple[tuple[WriteItem, ...], int]:
    """Items neither the optimizers nor ``after_step`` own first (copied before a lazy save
    returns), then theirs; -> (items, how many come first)."""
    owned = optimizer_storages(optimizers) | {_storage(t) for t in after_step}
    # by map over the items (no Python per tensor): whether each one's storage is owned
    mine = list(map(owned.__contains__, map(_DATA_PTR, map(_UNTYPED_STORAGE, map(
        sources.__getitem__, map(_KEY, items))))))
    eager = tuple(compress(items, map(operator.not_, mine)))
    return eager + tuple(compress(items, mine)), len(eager)


def lazy_versions(items: Sequence[WriteItem],
                  sources: dict[str, torch.Tensor]) -> dict[str, int]:
    """The version counter of each tensor a lazy save copies in the background, read when the
    save is called: every in-place change (an optimizer's step, ``p.mul_()``, ``copy_``,
    ``resize_``) advances it, so the capture can tell a tensor changed before it was copied.
    Inference tensors keep no counter and are left out."""
    keys = list(map(_KEY, items))
    tensors = list(map(sources.__getitem__, keys))
    if any(map(_IS_INFERENCE, tensors)):
        pairs = [(k, t) for k, t in zip(keys, tensors) if not t.is_inference()]
        keys, tensors = [k for k, _ in pairs], [t for _, t in pairs]
    return dict(zip(keys, map(_VERSION, tensors)))


def check_unchanged(path: str, versions: dict[str, int], sources: dict[str, torch.Tensor]) -> None:
    """After a lazy capture, before any optimizer step may run: CkptError naming the tensors
    changed in place since the save was called (their copy may hold the new values, or part
    of them), so that such a save fails instead of committing values the state never had at
    the call."""
    changed = []
    for key, version in versions.items():
        tensor = sources[key]
        if tensor._version != version:
            changed.append(key)
    if changed:
        raise CkptError(
            f"the save to {path} is not committed: {len(changed)} tensor(s) it copies in the background "
            f"({', '.join(map(repr, changed[:3]))}{', ...' if len(changed) > 3 else ''}) were "
            "changed in place after async_save(lazy=True) returned and before the save had "
            "copied them (a change outside the optimizer's step(): p.mul_() or copy_() under "
            "no_grad, resize_, a load into them). Change them only through step(), or only once "
            "handle.staged() is true (handle.wait() waits for it), or save with lazy=False")


def after_step_tensors(after_step: Sequence[torch.nn.Module | torch.Tensor],
                       lazy: bool) -> tuple[torch.Tensor, ...]:
    """async_save(after_step=...) as tensors: each module's parameters, each tensor itself."""
    if after_step and not lazy:
        raise CkptError("async_save(after_step=...) applies to lazy saves: pass lazy=True too "
                        "(an eager save copies everything before it returns)")
    tensors: list[torch.Tensor] = []
    for i, value in enumerate(after_step):
        if isinstance(value, torch.nn.Module):
            tensors.extend(p.detach() for p in value.parameters())
        elif isinstance(value, torch.Tensor):
            tensors.append(value.detach())
        else:
            raise CkptError(f"async_save(after_step=...): item {i} is a {type(value).__name__}; "
                            "pass modules (their parameters) or tensors")
    return tuple(tensors)
