"""The ``az://`` scheme in one place: a checkpoint is a prefix in an Azure Blob Storage container.

Its registry entry (storage/select.py) names the parts, each importing the ones below it:

    az_settings.py  AzureSettings (Options.storage["az"]): the account, deadline, concurrency
    az_client.py    URLs (AzPath), the azure-storage-blob client, the retry loop, errors
    az_backend.py   AzureBackend, the IOBackend: staged blocks and ranged reads
    az_lock.py      a save's claim on a prefix: a lease on a lock blob, renewed
    az_store.py     AzureBucket (the requests on a container) and AzureStore:
                    storage/object_tree.py's ObjectTreeStore over it, one checkpoint prefix
    az_root.py      AzureRoot: tree_root.MarkedTreeRoot over an AzureStore (steproot.py)

Internal: nothing here is public API (users give the settings as ``Options(storage={"az":
{...}})``, a mapping of AzureSettings' fields). Nothing here is imported until an ``az://``
location is used (azure-storage-blob is the ``[azure]`` extra's).

Owns: everything particular to Azure Blob Storage. Does not own: the contracts it implements,
the deadline and outage bookkeeping it shares with S3 (storage/s3/timeouts.py).
"""

from __future__ import annotations

__all__ = ["az_backend", "az_client", "az_lock", "az_root", "az_settings", "az_store"]
