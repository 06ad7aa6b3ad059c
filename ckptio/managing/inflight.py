"""A manager's save in flight into its first tier: InFlight.

Call order per save: ``refusal()`` (rank 0, agreed), ``settle()`` when a delta's base is to be
chosen among the committed steps, then ``save()`` or ``async_save()``; ``wait()`` from the
manager's wait(). Each returns the steps of ours that committed meanwhile: the manager runs the
first tier's retention and its followers for each, only after the commit (a failed save never
costs an older step; with async saves, SaveHandle having no done-callback, in wait(), the next
save or close()).

Owns: the one async save in flight (step, handle, the base it is a delta against). Does not
own: saving (api.Checkpointer), retention (level.py), the followers (managing/manager.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptio import stepmeta
from ckptio.api import Checkpointer
from ckptio.errors import CkptError, SaveTimeoutError, restated
from ckptio.managing.level import TierSteps
from ckptio.saving.handle import SaveHandle, SaveResult

__all__ = ["InFlight"]

log = logging.getLogger("ckptio")
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Pending:
    step: int
    handle: SaveHandle
    base: int | None


class InFlight:
    """The first tier's async save in flight, if any (module docstring)."""

    def __init__(self, first: TierSteps | None = None) -> None:
        self._first = first  # told of a delta save that failed on its base (base_failed)
        self._pending: _Pending | None = None
        self._above: int | None = None  # no tier held an undamaged step above this one
        self._foreign: dict[int, set[int]] | None = None  # tier -> steps holding a
        # torch_checkpointing checkpoint (their incomplete steps, listed at the first save)

    def base_in_flight(self) -> set[int]:
        """The base of the delta save in flight: retention keeps it."""
        pending = self._pending
        return set() if pending is None or pending.base is None else {pending.base}

    def refusal(self, levels: Sequence[TierSteps], step: int,
                metrics: Mapping[str, Any] | None, metadata: Mapping[str, Any] | None, *,
                taken_over: int | None = None) -> str | None:
        """Rank 0: why ``step`` may not be saved into the first of ``levels`` (the manager's
        tiers) now, or None; a CkptError for bad metrics or metadata. ``taken_over``: the step
        this job restored after taking the run over (take_over=True). Finishes a removal of
        ``step`` still pending there first. A committed step is never saved over, except one a
        load found damaged (the atomic commit replaces it safely), nor a step older than an
        undamaged committed one of any tier (a rollback), nor into a step's directory holding
        a torch_checkpointing checkpoint (its files would go with the step)."""
        stepmeta.encode(metrics, metadata)
        level = levels[0]
        path, pending = level.path(step), self._pending
        if pending is not None and pending.step == step and not pending.handle.done():
            return f"step {step} is being saved already ({path}): wait() for it, or save another"
        level.finish_removal(step)
        taken = level.is_committed(step) and not level.is_damaged(step)
        listed = None
        if self._foreign is None:  # listed once, at the manager's first save (run leased)
            listed = self._scan(levels, step)
        held = self._held(levels, step) if self._foreign else []  # mostly none: no call
        if held and not taken:
            return (f"step {step} was not saved: {held[0]} holds a torch_checkpointing "
                    "checkpoint, and a save there would put ckptio's files beside its files, "
                    "which the retention would then delete with the step; move it out of the "
                    "run directory first (ckptio.load reads it where it is; python -m ckptio "
                    "convert copies it into another run directory) or save another step")
        newer = self._newer(levels, step, listed)
        if taken and not newer:
            return (f"step {step} already has a committed checkpoint at {path}; steps are never "
                    f"saved over: save under another step number, or remove {path} first to "
                    "replace it")
        if not newer:
            return None
        where = "; ".join(f"{steps[:10]} in {tier}" for tier, steps in newer.items())
        last = max(s for steps in newer.values() for s in steps)
        also = f" (and step {step} itself is committed at {path})" if taken else ""
        fix = (f"After a rollback (restore(state, step=N)), remove those newer steps first "
               f"(they belong to the run rolled back from), or save under step numbers above "
               f"{last}" if taken_over is None else
               f"This job took the run over (take_over=True) after restoring step {taken_over}: "
               "the newer steps are the other job's, saved while it still ran (it stops at its "
               "next save, its lease lost); stop that job, then restart this one to resume from "
               "its newest step")
        return (f"step {step} is older than step(s) committed before it{also}: {where}. restore() "
                "resumes from the newest step and retention keeps the newest, so this save "
                f"would be dropped or passed over, and a restart would resume from step {last}. "
                + fix)

    def _held(self, levels: Sequence[TierSteps], step: int) -> list[str]:
        """The directories of ``step`` in the tiers it goes to that hold a torch_checkpointing
        checkpoint (as the first save listed them)."""
        return [levels[i].path(step) for i, steps in (self._foreign or {}).items()
                if step in steps and (i == 0 or step % levels[i].every == 0)]

    def _scan(self, levels: Sequence[TierSteps], step: int) -> dict[int, list[int]]:
        """Each tier's committed steps (by index; a tier other than the first that cannot be
        listed left out, logged: its drains report it), and, kept, the incomplete steps of
        each that hold a torch_checkpointing checkpoint, from the same listing."""
        committed: dict[int, list[int]] = {}
        self._foreign = {}
        for index, level in enumerate(levels):
            try:
                listing = level.scan()
            except CkptError as exc:
                if index == 0:
                    raise
                log.warning("ckptio: the check for steps newer than %d passed over tier %s, "
                            "which could not be listed: %s", step, level.directory, exc)
                continue
            committed[index] = listing["committed"]
            foreign = level.foreign(listing["incomplete"])
            if foreign:
                self._foreign[index] = set(foreign)
        return committed

    def _newer(self, levels: Sequence[TierSteps], step: int,
               listed: dict[int, list[int]] | None) -> dict[str, list[int]]:
        """Each tier's undamaged committed steps above ``step``, ascending (tiers with none
        left out): listed at a manager's first save (``listed``: _scan(), just now) and for a
        step not above the last one checked (after that, only this manager commits there: the
        run's lease)."""
        if self._above is not None and step > self._above:
            self._above = step
            return {}
        if listed is None:
            listed = self._scan(levels, step)
        newer: dict[str, list[int]] = {}
        for index, committed in listed.items():
            level = levels[index]
            above = [s for s in committed if s > step and not level.is_damaged(s)]
            if above:
                newer[level.directory] = above
        if not newer:
            self._above = step
        return newer

    def save(self, ck: Checkpointer, step: int, path: str, state: Any, base: int | None,
             kwargs: dict[str, Any]) -> tuple[SaveResult, list[int]]:
        """A synchronous save (it settles the save in flight first, raising its unseen error)
        -> its result, and the steps committed (the previous one's too, if it did)."""
        previous = self._pending
        result = self._started(previous, step, base, lambda: ck.save(state, path, **kwargs))
        return result, [*self._ok(previous), step]

    def async_save(self, ck: Checkpointer, step: int, path: str, state: Any, base: int | None,
                   kwargs: dict[str, Any]) -> tuple[SaveHandle, list[int]]:
        """An async save (the previous one settled first) -> its handle, and the steps
        committed meanwhile (the previous one, if it did)."""
        previous = self._pending
        handle = self._started(previous, step, base,
                               lambda: ck.async_save(state, path, **kwargs))
        self._pending = _Pending(step, handle, base)
        return handle, self._ok(previous)

    def _started(self, previous: _Pending | None, step: int, base: int | None,
                 call: Callable[[], _T]) -> _T:
        """``call()``, a save of ``step`` that settles ``previous`` first; its error raised
        again with the step it cost said (the previous one's, where that failed)."""
        try:
            return call()
        except BaseException as exc:  # noqa: BLE001 - raised again, with the step said
            said = _not_saved(exc, previous, step)
            self._failed(previous.base if said is not exc and previous else base, exc)
            if said is exc:
                raise
            raise said from exc.__cause__
        finally:
            self._forget_done(previous)

    def wait(self, timeout: float | None = None) -> tuple[SaveResult | None, list[int]]:
        """Wait for the save in flight (its error raised here) -> its result and [its step].
        SaveTimeoutError after ``timeout`` seconds: the save stays in flight."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None, []
        try:
            return pending.handle.wait(timeout), [pending.step]
        except SaveTimeoutError as exc:
            self._pending = pending
            raise restated(exc, f"step {pending.step}: ") from None
        except BaseException as exc:  # noqa: BLE001 - raised again
            self._failed(pending.base, exc)
            raise

    def settle(self, ck: Checkpointer, before: int | None = None) -> list[int]:
        """The save in flight finishes (as the Checkpointer's next save would wait for it, on
        every rank alike), its unseen error raised here -> [its step] if it committed.
        ``before``: the step about to be saved, which that error then costs (said so)."""
        pending = self._pending
        if pending is None:
            return []
        try:
            ck.settle()
        except BaseException as exc:  # noqa: BLE001 - raised again
            self._failed(pending.base, exc)
            if before is None or not isinstance(exc, CkptError):
                raise
            raise restated(exc, f"step {before} was not saved (nothing of it was written): "
                                f"the save of step {pending.step} before it failed in the "
                                "background: ") from exc.__cause__
        finally:
            self._pending = None
        return self._ok(pending)

    def _failed(self, base: int | None, exc: BaseException) -> None:
        """A save against ``base`` failed with ``exc``: the first tier is told (a base found
        damaged is not chosen again: level.base_failed)."""
        if base is not None and self._first is not None:
            self._first.base_failed(base, exc)

    def _forget_done(self, previous: _Pending | None) -> None:
        if previous is not None and self._pending is previous and previous.handle.done():
            self._pending = None

    @staticmethod
    def _ok(pending: _Pending | None) -> list[int]:
        """[the step] of a finished async save that committed, else []. Its error, if any, has
        been reported already (the Checkpointer raises an error nobody has seen, so reaching
        here means the caller's own wait() raised it); it is only looked at here."""
        if pending is None or not pending.handle.done():
            return []
        try:
            pending.handle.wait()
        except Exception:  # noqa: BLE001 - reported already (see above)
            return []
        return [pending.step]


def _not_saved(exc: BaseException, previous: _Pending | None, step: int) -> BaseException:
    """A save of ``step`` refused because the async save before it had failed in the
    background (the Checkpointer raises that error restated, caused by it): said with both
    steps. Any other error: ``exc`` itself."""
    cause = exc.__cause__
    if previous is None or cause is None or not previous.handle.done():
        return exc
    try:
        previous.handle.wait(0)
    except BaseException as seen:  # noqa: BLE001 - compared, not handled
        if seen is cause:
            return restated(cause, f"step {step} was not saved (nothing of it was written): "
                                   f"the save of step {previous.step} before it failed in the "
                                   "background: ")
    return exc
