"""One host's staging budget, shared by the ranks that run on it (issue 67).

An async save grows its rank's staging pool (resources.py) within the host's budget:
Options.host_budget_bytes, or half of the memory available. It is the host's, not the
process's: 8 ranks on a host hold the budget once in all, not 8 times.

How: each rank takes an equal share, the budget divided by the ranks of its host
(``local_world_size``). Not a host-wide ledger (reservations in a file under /dev/shm): a
pool is grown once and kept for every later save, so a ledger would hand whichever rank saves
first a lasting larger share and the last ones less, decided by timing; the ranks of a job
save states of like size at once, so an even share loses little; and a share needs no shared
state, so a rank killed with kill -9 leaves nothing behind that the others wait for. The
protection's send rate is shared by a host's ranks the same way (redundancy/protect.py).

The floor: a pool never shrinks below the one a save streams through (Options.pool_bytes, or
a smaller state's size), and any tensor, the largest too, streams through it buffer by buffer;
so a share below it stops no save: that pool stays at the floor, and the host holds at most
max(budget, ranks x floor).

Owns: the ranks per host, the host's budget, a rank's share. Does not own: growing the pool
(resources.py), the pool itself (stage.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptio.errors import CkptError
from ckptio.io.stage import available_host_bytes
from ckptio.options import GiB, MiB

__all__ = ["LOCAL_SIZE_ENVS", "HostBudget", "host_budget", "local_world_size", "size_text"]

# where launchers put the number of ranks on this host, first found wins: torchrun (and
# accelerate, DeepSpeed's launcher), Open MPI's mpirun, MPICH / Intel MPI's hydra
LOCAL_SIZE_ENVS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def local_world_size() -> int:
    """The ranks of this job on this host, as the launcher says (LOCAL_SIZE_ENVS); 1 where
    none says (a single process). CkptError for a value that is not a positive integer."""
    for name in LOCAL_SIZE_ENVS:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        count = int(raw) if raw.isdigit() else 0
        if count < 1:
            raise CkptError(f"{name}={raw!r}: the number of ranks on this host must be a "
                            f"positive integer (the host's staging budget, "
                            f"Options.host_budget_bytes, is shared by them); set it to the "
                            "ranks per host, as torchrun does, or unset it for one process")
        return count
    return 1


@dataclass(frozen=True)
class HostBudget:
    """The host's staging budget (``nbytes``) shared by its ``ranks``; ``explicit``: given as
    Options.host_budget_bytes, not derived from the memory available."""

    nbytes: int
    ranks: int
    explicit: bool

    @property
    def share(self) -> int:
        """The bytes of staging this rank's pool may grow to."""
        return self.nbytes // self.ranks

    def describe(self) -> str:
        """For messages: the share and where it comes from."""
        whole = ("Options.host_budget_bytes" if self.explicit
                 else "Options.host_budget_bytes=None: half of the memory available")
        if self.ranks == 1:
            return f"{size_text(self.share)}: {whole}"
        return (f"{size_text(self.share)}: this rank's share of the host's "
                f"{size_text(self.nbytes)} ({whole}) over its {self.ranks} ranks")


def size_text(nbytes: int) -> str:
    """``nbytes`` for a message: in GiB from 1 GiB on, else in MiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def host_budget(explicit: int | None, pool_nbytes: int, ranks: int) -> HostBudget:
    """The host's budget: ``explicit`` (Options.host_budget_bytes), or half of the memory
    available now with this rank's pool (``pool_nbytes``) counted as available."""
    if explicit is not None:
        return HostBudget(explicit, ranks, explicit=True)
    return HostBudget((available_host_bytes() + pool_nbytes) // 2, ranks, explicit=False)
