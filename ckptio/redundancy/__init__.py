"""Redundancy of a memory tier across hosts: a step's copies on other hosts (partners) or its
parity, so that a lost host's step is rebuilt from the survivors (``Tier("shm://run",
redundancy=ckptio.Partners(1))``, ``ckptio.Parity(k=3)``).

The parts, each importing the ones above it in this list:

    redundancy.py, topology.py  Partners and Parity as declared; the hosts, the placement rules
    budget.py, marks.py  a sender's bandwidth budget; each host's names and markers (torch-free)
    erasure.py     the two-parity code (XOR and Reed-Solomon over GF(2^8)); pure
    peers.py       a step's bytes and how they move between ranks (gloo)
    protect.py     the protection thread: copies or parity sent after each save
    stripes.py     a lost rank's shard rebuilt by the survivors, chained per piece
    landing.py     a received step checked as its chunks land, loaded, then written to the tier
    recovery_plan.py  the restore's plan: inventories, the step every rank can obtain (pure)
    rebuild.py     the restore: the transfers of that plan, verified, brought back
    pieces.py, regrow.py, reshard_fetch.py, elastic.py  a restart on another number of ranks:
                   which piece from where (pure), one held nowhere rebuilt from parity, only
                   the rows each new shard needs fetched, the search and its effects

Layer: the drivers' (below managing/, which composes it through managing/guard.py; nothing here
imports managing/). Internal: nothing here is public API. The public surface is
``ckptio`` itself (``ckptio.Partners``, ``ckptio.Parity``).

Owns: the copies and parity across hosts, their transport and rebuild. Does not own: the tier,
its steps, retention or the restore loop (managing/).
"""

__all__: list[str] = []
