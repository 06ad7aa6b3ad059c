"""GcsRoot against a real GCS server (the gcp-storage-emulator): the StepRoot conformance suite
(ckptio/testing/steproot_conformance.py), its faults through the fault proxy (the marker's
upload denied: the hide refused; deletes denied: the removal failing, finished later)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from ckptio.errors import StorageIOError
from ckptio.storage.gcs.gcs_root import MARKER, GcsRoot
from ckptio.storage.gcs.gcs_store import GcsStore
from ckptio.storage.steproot import StepRoot
from ckptio.testing.s3proxy import FaultProxy
from ckptio.testing.steproot_conformance import Roots, StepRootConformance, commit_by_store

from gcs.conftest import settings_at


def _roots(base: str, proxy: FaultProxy, direct: str) -> Roots:
    """Roots reached through the proxy (so faults can be injected); stores straight."""
    store_at = lambda location: GcsStore(location, settings_at(direct))  # noqa: E731
    return Roots(make=lambda key: GcsRoot(f"{base}/{key}", settings_at(proxy.endpoint)),
                 store_at=store_at, commit=commit_by_store(store_at))


def _denied(proxy: FaultProxy, **match: object) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def denied() -> Iterator[None]:
        proxy.fail(403, "AccessDenied", times=None, **match)
        try:
            yield
        finally:
            proxy.clear()

    return denied()


class TestGcsRoot(StepRootConformance):
    @pytest.fixture
    def roots(self, gcs_url, gcs_proxy, gcs_server) -> Roots:
        return _roots(gcs_url, gcs_proxy, gcs_server.endpoint)

    @pytest.fixture
    def refuse_hide(self, gcs_proxy):
        """The marker's upload is denied: the step cannot be hidden."""
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            return _denied(gcs_proxy, method="POST", query={"uploadType": None})

        return refuse

    @pytest.fixture
    def refuse_removal(self, gcs_proxy):
        """Deletes are denied: a hidden step's objects cannot be removed."""
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            return _denied(gcs_proxy, method="DELETE")

        return refuse


def test_a_save_into_a_step_whose_removal_cannot_finish_is_refused(gcs_url, gcs_proxy,
                                                                   gcs_server):
    roots = _roots(gcs_url, gcs_proxy, gcs_server.endpoint)
    root = roots.make("blocked")
    assert roots.commit is not None
    roots.commit(root.path(1))
    assert root.hide(1)
    with _denied(gcs_proxy, method="DELETE"):
        finish = root.removal(1)
        assert finish is not None
        with pytest.raises(StorageIOError, match="cannot save into .*step-1"):
            finish()
    assert root.scan() == {"committed": [], "incomplete": []}
    finish = root.removal(1)
    assert finish is not None, "the marker of the unfinished removal was not kept"
    finish()
    assert root.removal(1) is None
    assert re.search(MARKER, str(GcsStore(root.path(1), settings_at(gcs_server.endpoint)).entries())) is None
