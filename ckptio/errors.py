"""The one exception family ckptio raises.

Owns: CkptError and its subclasses, restating one with more said first or in a caller's
terms (``in_terms``: an integration naming its own options), and refusing a
``timeout=`` that is not a number of seconds (every public wait's argument). Every message
names what went wrong (key, file, rank where known) and how to fix it. Does not own: deciding
when to raise (each module raises its own).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

__all__ = ["CAST_HINT", "CheckpointLockedError", "CheckpointNotFoundError", "CkptError",
           "CorruptCheckpointError", "IncompleteCheckpointError", "ManifestError",
           "PickleRefusedError", "RankFailedError", "SaveTimeoutError", "StateMismatchError",
           "StorageIOError", "UnsupportedPathError", "UnsupportedStateError", "in_base", "in_terms",
           "refixed", "restated", "seconds_to_wait"]


class CkptError(Exception):
    """Base of every error ckptio raises on purpose."""


class CheckpointNotFoundError(CkptError):
    """The path holds no checkpoint at all."""


class IncompleteCheckpointError(CkptError):
    """A directory exists but no manifest was ever committed there (an interrupted save)."""


class CorruptCheckpointError(CkptError):
    """Bytes on storage disagree with the manifest: checksum, size or structure. ``base``: the
    step name of a delta save's base checkpoint whose bytes the save found damaged (in_base);
    None for any other damage."""

    base: str | None = None


class ManifestError(CorruptCheckpointError):
    """The manifest itself cannot be parsed, fails its checksum or breaks the schema."""


class UnsupportedStateError(CkptError):
    """The state to save holds something ckptio will not store (as asked)."""


CAST_HINT = " (pass cast=True to convert)"  # a dtype's line: load's own argument, as ``fix``


class StateMismatchError(CkptError):
    """The destination state does not match the checkpoint (keys, dtypes, shapes). ``fix``:
    the end of the message that names ckptio.load's own arguments (strict=, keys=) as the fix,
    which an integration whose user cannot pass them replaces with its own (refixed); a
    dtype's line names cast= (CAST_HINT), which ``problem`` leaves out too."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message + fix)
        self.fix = fix

    @property
    def problem(self) -> str:
        """The message without its ``fix``: what does not match, with no fix of load's."""
        said = str(self)
        said = said[:-len(self.fix)] if self.fix and said.endswith(self.fix) else said
        return said.replace(CAST_HINT, "").rstrip(" .")


class PickleRefusedError(CkptError):
    """Loading would unpickle, and the caller did not opt in."""


class UnsupportedPathError(CkptError):
    """The path names storage ckptio does not serve (a URL scheme such as s3://)."""


class StorageIOError(CkptError):
    """An I/O call failed; the message names the file and the operation."""


class RankFailedError(CkptError):
    """A collective save or load failed on one or more ranks; raised on every rank, naming them.
    ``ranks``: the ranks (of the save's or load's process group) found dead or stuck, when
    that is why (empty when a rank reported an error of its own, which the message quotes).
    ``kinds``: the class names of the errors the failing ranks reported (a rank's own
    CorruptCheckpointError: "CorruptCheckpointError"), in rank order; empty when none did."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (),
                 kinds: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.kinds = kinds


class CheckpointLockedError(CkptError):
    """Another save holds the path (Options.if_locked="raise"), or committed there while this
    save ran because the path's lock is not honoured; the message names the path and the
    holder. Nothing of this save was committed; the checkpoint there is untouched."""


class SaveTimeoutError(CkptError, TimeoutError):
    """``wait(timeout=...)`` or ``close(timeout=...)`` gave up on a save still running; the
    message names the path, the rank and the file whose write, fsync or commit it waits for.
    The save goes on in the background (a call in the kernel cannot be cancelled): wait again,
    or kill the process (a normal exit waits for the save); nothing partial is committed."""


def restated(error: BaseException, prefix: str, *, replacing: str = "") -> BaseException:
    """A copy of ``error`` (same type, same attributes) whose message begins with ``prefix``
    (in place of ``replacing``, where its message begins with that: a caller's own restatement
    of it); a CkptError caused by it where it is not one (an OSError's message is not its
    args[0]); an interrupt (KeyboardInterrupt, SystemExit) itself, unchanged."""
    if not isinstance(error, Exception):
        return error
    if not isinstance(error, CkptError):
        wrapped = CkptError(f"{prefix}{type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped
    again = copy.copy(error)
    said = str(error)
    again.args = (f"{prefix}{said.removeprefix(replacing) if replacing else said}",
                  *error.args[1:])
    return again


def refixed(error: StateMismatchError, fix: str) -> StateMismatchError:
    """A copy of ``error`` (same type, same attributes) whose message ends with ``fix`` (a
    caller's own, in its user's terms) in place of its own fix in ckptio.load's arguments."""
    again = copy.copy(error)
    again.fix = f". {fix}"
    again.args = (f"{error.problem}{again.fix}", *error.args[1:])
    return again


@contextlib.contextmanager
def in_terms(terms: Sequence[tuple[str, str]]) -> Iterator[None]:
    """A CkptError raised inside, whose message says any ``(ours, theirs)`` pair's ``ours``
    (an argument of ckptio's API), raised again saying ``theirs`` (the option the caller's user
    sets): same type, same attributes (a rank's RankFailedError repeating it too)."""
    try:
        yield
    except CkptError as exc:
        said = reworded = str(exc)
        for ours, theirs in terms:
            reworded = reworded.replace(ours, theirs)
        if reworded == said:
            raise
        again = copy.copy(exc)
        again.args = (reworded, *exc.args[1:])
        raise again from None


def in_base(error: CorruptCheckpointError, name: str) -> CorruptCheckpointError:
    """A copy of ``error`` saying the damage is in base checkpoint ``name`` (its ``base``)."""
    again = copy.copy(error)
    again.base = name
    return again


def seconds_to_wait(call: str, timeout: object) -> float | None:
    """``timeout`` as the public waits take it (None: no limit; seconds >= 0), or a CkptError
    naming ``call``: a negative or NaN limit gave up at once and said the save was stuck."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise CkptError(f"{call}(timeout={timeout!r}): a number of seconds >= 0, or None to "
                        "wait as long as it takes")
    return float(timeout)
