"""The ``gs://`` scheme in one place: a checkpoint is a prefix in a Google Cloud Storage bucket.

Its registry entry (storage/select.py) names the parts, each importing the ones below it:

    gcs_settings.py  GcsSettings, the scheme's settings (Options.storage["gs"])
    gcs_client.py    URLs (GcsPath), the google-cloud-storage client, the retry loop, errors
    gcs_backend.py   GcsBackend, the IOBackend: resumable uploads and ranged reads
    gcs_lock.py      a save's claim on a prefix: a lock object with a lease
    gcs_store.py     GcsBucket (the requests on a bucket) and GcsStore: storage/object_tree.py's
                     ObjectTreeStore over it, the Store of one checkpoint prefix
    gcs_root.py      GcsRoot: tree_root.MarkedTreeRoot over a GcsStore (steproot.py)

Internal: nothing here is public API (the public surface is ``ckptio`` itself). Nothing here
is imported until a ``gs://`` location is used (google-cloud-storage is the ``[gcs]`` extra's).

Owns: everything particular to GCS. Does not own: the contracts it implements, the order of a
save (saving/).
"""

from __future__ import annotations

__all__ = ["gcs_backend", "gcs_client", "gcs_lock", "gcs_root", "gcs_settings", "gcs_store"]
