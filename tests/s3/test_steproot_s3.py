"""S3Root against a real SeaweedFS server: the StepRoot conformance suite
(ckptio/testing/steproot_conformance.py), with its faults through the fault proxy (a marker PUT
denied: the hide refused; DeleteObjects denied: the removal failing and finished later), and a
save into a step whose pending removal cannot be finished."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import pytest

from ckptio.errors import StorageIOError
from ckptio.storage.s3.settings import S3Settings
from ckptio.options import Options
from ckptio.storage.steproot import StepRoot
from ckptio.storage.s3.root import MARKER, S3Root
from ckptio.storage.s3.store import S3Store
from ckptio.testing.s3proxy import FaultProxy
from ckptio.testing.steproot_conformance import (
    Roots,
    StepRootConformance,
    commit_by_ckptio,
    commit_by_store,
)


def _settings(**changes: object) -> S3Settings:
    return dataclasses.replace(S3Settings.of(Options()), **changes)


def _store(location: str) -> S3Store:
    return S3Store(location, _settings())


def _roots(base: str, proxy: FaultProxy, *, by_ckptio: bool = False) -> Roots:
    """Roots reached through the proxy (so faults can be injected); stores straight."""
    proxied = _settings(endpoint_url=proxy.endpoint)
    return Roots(make=lambda key: S3Root(f"{base}/{key}", proxied), store_at=_store,
                 commit=commit_by_ckptio if by_ckptio else commit_by_store(_store))


def _denied(proxy: FaultProxy, **match: object) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def denied() -> Iterator[None]:
        proxy.fail(403, "AccessDenied", times=None, **match)
        try:
            yield
        finally:
            proxy.clear()

    return denied()


class TestS3Root(StepRootConformance):
    @pytest.fixture
    def roots(self, s3_env, s3_proxy) -> Roots:
        return _roots(s3_env, s3_proxy)

    @pytest.fixture
    def refuse_hide(self, s3_proxy):
        """The marker's PUT is denied: the step cannot be hidden."""
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            key = re.escape(f"step-{step}/{MARKER}") + "$"
            return _denied(s3_proxy, method="PUT", key=key)

        return refuse

    @pytest.fixture
    def refuse_removal(self, s3_proxy):
        """DeleteObjects is denied: a hidden step's objects cannot be removed."""
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            return _denied(s3_proxy, method="POST", query={"delete": None})

        return refuse


def test_steps_saved_by_ckptio_are_listed_and_removed(s3_env, s3_proxy):
    """The suite's central checks with real ckptio.save commits (not only the store's)."""
    from ckptio.testing import steproot_conformance as suite

    roots = _roots(s3_env, s3_proxy, by_ckptio=True)
    suite.check_scan_lists_steps_ascending(roots)
    suite.check_hide_then_removal(roots)


def test_a_save_into_a_step_whose_removal_cannot_finish_is_refused(s3_env, s3_proxy):
    """removal(step), run before a save into a hidden step, raises naming the step and what
    to check while DeleteObjects is denied; the marker stays (the step stays out of the
    listing); once allowed it finishes and the step can be saved again."""
    roots = _roots(s3_env, s3_proxy)
    root = roots.make("blocked")
    commit_by_store(_store)(root.path(1))
    assert root.hide(1)
    with _denied(s3_proxy, method="POST", query={"delete": None}):
        finish = root.removal(1)
        assert finish is not None
        with pytest.raises(StorageIOError, match="cannot save into .*step-1") as info:
            finish()
    assert "DeleteObject" in str(info.value), "the message names the permission to check"
    assert root.scan() == {"committed": [], "incomplete": []}
    finish = root.removal(1)
    assert finish is not None, "the marker of the unfinished removal was not kept"
    finish()
    assert root.removal(1) is None
    commit_by_store(_store)(root.path(1))
    assert root.scan() == {"committed": [1], "incomplete": []}
