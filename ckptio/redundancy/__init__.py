"""Redundancy of a memory tier across hosts: a step's copies on other hosts (partners) or its
parity, so that a lost host's step is rebuilt from the survivors (``Tier("shm://run",
redundancy=ckptio.Partners(1))``, ``ckptio.Parity(k=3)``).

The parts, each importing the ones above it in this list:

    redundancy.py  Partners and Parity, as the user declares them (public through ``ckptio``)
    topology.py    the job's hosts and the placement rules (who holds whose copy or parity)
    budget.py      a sender's bandwidth budget (a token bucket), so protection leaves the link
    marks.py       the names and markers each host keeps; torch-free (``ckptio ls`` reads them)
    erasure.py     the two-parity code (XOR and Reed-Solomon over GF(2^8)); pure
    peers.py       a step's bytes and how they move between ranks (gloo)
    protect.py     the protection thread: copies or parity sent after each save
    stripes.py     a lost rank's shard rebuilt by the survivors, chained per piece
    rebuild.py     the restore: the newest step every rank can obtain, verified, brought back
    pieces.py      a restart on another number of ranks: which piece from where (pure)
    regrow.py      a piece held nowhere rebuilt from parity for such a restart
    elastic.py     that restart's effects

Layer: the drivers' (below managing/, which composes it through managing/guard.py; nothing here
imports managing/). Internal: nothing here is public API. The public surface is
``ckptio`` itself (``ckptio.Partners``, ``ckptio.Parity``).

Owns: the copies and parity across hosts, their transport and their rebuild. Does not own: the
tier, its steps and retention, or the restore loop (managing/).
"""

__all__: list[str] = []
