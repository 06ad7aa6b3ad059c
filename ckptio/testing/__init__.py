"""Test support for ckptio and for anyone writing a store or backend for it.

Owns the conformance suites, each usable from pytest as a base class to subclass with a factory
or as plain functions: ``store_conformance`` (every Store), ``io_conformance`` (every IOBackend,
through its store's files by name), ``steproot_conformance`` (every StepRoot a manager keeps its
steps in); ``faults`` (an IOBackend wrapper that fails chosen calls, to show that a failing
save commits nothing and a failing load leaks nothing); the helpers that run real ranks
(``rank_processes``, ``killed``), a real S3 server (``s3server``, ``s3proxy``) and Azure
Blob server (``azurite``); ``accepts_o_direct``.
Nothing here is imported by ckptio itself; pytest is needed only by the base classes.

Test support, not ckptio's public API (that is ``ckptio`` itself, ckptio/__init__.py's
``__all__``): it may import any layer, and no other part of ckptio imports it
(tests/test_layers.py).
"""

from __future__ import annotations

import errno
import os

__all__ = ["accepts_o_direct"]


def accepts_o_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs before Linux 6.6: no)."""
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    else:
        os.close(fd)
        return True
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
