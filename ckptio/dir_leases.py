"""One live job per checkpoint directory for the framework plugins that save without a
CheckpointManager: the run lease a manager takes (storage/local/runlease.py), on the local
directories a plugin saves into.

Two training jobs started on one checkpoint directory interleave their saves: Lightning's
``last.ckpt`` or DeepSpeed's ``global_step<N>`` tags of one job replaced by the other's, and
``latest`` naming either. ``DirectoryLeases`` takes the lease of each local directory a plugin
saves into at its first save there and holds it until the plugin's teardown: a second job's
first save there is refused (CheckpointLockedError naming the holder) before it writes
anything; a job started with ``take_over=True`` goes on with a warning, and the holder's next
save there is refused, naming the one that took over. A directory of an object store is not
leased here (its saves' own locks apply).

Call order: the plugin makes one (its job's words for the refusal and the fix), calls
``take(directory, what)`` before each save writes (``taken_on_rank_0`` where every rank saves
together: rank 0 holds the lease, every rank raises its refusal), and ``release()`` at its
teardown. A job giving each save a folder of its own (the Hugging Face Trainer's
``checkpoint-N`` as DeepSpeed's ``save_dir``) holds the leases of the MOST_HELD folders it saved
into last, and none of a folder since removed (its rotation): a lease let go is taken again,
and checked, at the next save there.

Owns: which directories a plugin holds and the taken-over refusal's wording. Does not own: the
lease file and its lock (runlease.py), the plugins (lightning.py, deepspeed_engine.py).
"""

from __future__ import annotations

import os

from ckptio.distributed.dist import Group
from ckptio.errors import CheckpointLockedError, CkptError, StorageIOError
from ckptio.storage.local import runlease
from ckptio.storage.select import checkpoint_path, scheme_of

__all__ = ["MOST_HELD", "DirectoryLeases", "taken_on_rank_0"]

MOST_HELD = 8  # leases one plugin holds at most: those of the folders it saved into last


class DirectoryLeases:
    """The run leases of the local directories one plugin saves into (module docstring).
    ``job``: what the refusal calls this job ("this Lightning job"); ``fix``: how to go on past
    a holder whose processes linger ("pass ... take_over=True"); ``take_over``: do so."""

    def __init__(self, job: str, fix: str, take_over: bool = False) -> None:
        self.job, self.fix, self.take_over = job, fix, take_over
        self._held: dict[str, runlease.RunLease] = {}

    def take(self, directory: str, what: str) -> None:
        """The lease of ``directory`` (a local path or ``shm://``; an object store's is not
        leased) before this job saves ``what`` there: at the first save, CheckpointLockedError
        naming the live job holding it; later, the job that took it over since."""
        location = checkpoint_path(directory)
        if scheme_of(location) is not None:
            return
        directory = os.path.abspath(location)
        held = self._held.pop(directory, None)
        if held is not None:
            self._held[directory] = held  # the newest again
            taker = held.lost
            if taker is not None:
                raise CheckpointLockedError(
                    f"the run directory {directory} was taken over by another job ({taker}, "
                    f"started with take_over=True): {self.job} did not save {what}, and saves "
                    "no more there; that job saves there now")
            return
        lease = runlease.take(directory, self.take_over, create=True,
                              refusal=(f"{self.job} did not save {what}", self.fix))
        if lease is not None:
            self._held[directory] = lease
            self._let_go(directory)

    def _let_go(self, newest: str) -> None:
        """Release the leases of the folders removed since this job saved there, and of all but
        the MOST_HELD folders saved into last (one lease and file descriptor per save of a job
        saving each step into a folder of its own would pile up until the teardown)."""
        gone = [d for d in self._held if d != newest and not os.path.isdir(d)]
        kept = [d for d in self._held if d not in gone]  # oldest first, ``newest`` last
        for directory in gone + kept[:max(0, len(kept) - MOST_HELD)]:
            self._held.pop(directory).release()

    def release(self) -> None:
        """Let go of every lease (never raises)."""
        held, self._held = self._held, {}
        for lease in held.values():
            lease.release()


def taken_on_rank_0(leases: DirectoryLeases, ranks: Group | None, directory: str,
                    what: str) -> None:
    """Rank 0 of ``ranks`` (None: this process alone) takes (or checks) the lease of
    ``directory`` before the ranks save ``what`` there together; every rank raises its refusal
    (CheckpointLockedError), or its error taking it (StorageIOError: the lease file cannot be
    opened or locked), before any rank writes."""
    error: CkptError | None = None
    if ranks is None or ranks.rank == 0:
        try:
            leases.take(directory, what)
        except (CheckpointLockedError, StorageIOError) as exc:
            error = exc
    if ranks is not None:
        said = ranks.all_gather(b"" if error is None else
                                f"{type(error).__name__}\n{error}".encode())
        if error is None and said[0]:
            kind, _, message = said[0].decode(errors="replace").partition("\n")
            error = (StorageIOError if kind == StorageIOError.__name__ else
                     CheckpointLockedError)(f"rank 0: {message}")
    if error is not None:
        raise error
