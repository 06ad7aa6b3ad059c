"""Tiers of checkpoints: host memory first, drained in the background to disk and object
storage, restored from the fastest verified copy (``ckptio.CheckpointManager(tiers=[...])``).

Layer: the drivers' (below manager.py, which uses it; nothing here imports the manager).

Internal: nothing here is public API. The public surface is ``ckptio`` itself:
``ckptio.Tier`` (tier.py), ``ckptio.Partners`` / ``ckptio.Parity`` (redundancy.py);
``ckptio.CheckpointManager(tiers=...)`` is ckptio/manager.py's one manager class.

Owns: tier.py (the declaration, the memory budget), copy.py (a verified copy of one committed
checkpoint between stores), drain.py (the background thread); the memory tier's redundancy
across hosts (issue 27):
redundancy.py (ckptio.Partners, ckptio.Parity), topology.py (the host topology and placement
rules), marks.py (names and markers on each host), peers.py (a step's bytes and the gloo
transport), erasure.py (the two-parity code), protect.py (the protection thread), rebuild.py,
recovery_plan.py, stripes.py and landing.py (restore's fetch and rebuild, verified, installed),
elastic.py, pieces.py, reshard_fetch.py and regrow.py (a restart on another number of ranks
from memory), guard.py (the manager's rank-local setup and its follower), worker.py (the one
background thread class of the drain and the protection). Nothing here imports
managing/ or the manager. Does not own: the manager, its tiers' steps and the agreed restore
(ckptio/manager.py, managing/, storage/steproot.py).
"""

__all__: list[str] = []
