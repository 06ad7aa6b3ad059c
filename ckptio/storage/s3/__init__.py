"""The ``s3://`` scheme in one place: a checkpoint is a prefix in an S3-compatible bucket.

Its registry entry (storage/select.py) names the three parts, each importing the ones below it:

    timeouts.py  how long one request may wait: its deadline, each attempt's timeout, outages
    settings.py  S3Settings, the scheme's settings (Options.storage["s3"] or Options.s3_*)
    s3path.py    URLs (S3Path): a bucket and a key
    client.py    the boto3 client, the retry loop, what an error means
    objects.py   what a store's look-up saw of an object, handed to the backend's reads
    body.py      a GET's body read into the caller's buffer, from the socket where it can be
    backend.py   S3Backend, the IOBackend: multipart uploads and ranged GETs (I/O contract:
                 io/backend_contract.py)
    lock.py      a save's claim on a prefix: a lock object with a lease
    store.py     S3Bucket (the requests on a bucket) and S3Store, storage/object_tree.py's core
                 over it: the Store of one checkpoint prefix (storage/store_contract.py)
    root.py      S3Root, a CheckpointManager's steps under a prefix (contract: steproot.py)

Internal: nothing here is public API. The public surface is ``ckptio`` itself
(ckptio/__init__.py's ``__all__``); these modules may change without notice. Nothing here is
imported until an ``s3://`` location is used (boto3 is the ``[s3]`` extra's).

Owns: everything particular to S3. Does not own: the contracts it implements (io/backend_contract.py,
storage/store_contract.py, storage/steproot.py), the order of a save (saving/).
"""

from __future__ import annotations

__all__ = ["backend", "body", "client", "lock", "objects", "root", "s3path", "settings",
           "store", "timeouts"]
