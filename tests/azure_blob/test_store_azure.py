"""AzureStore and AzureBackend against a real Azurite server: the Store conformance suite (the
TreeStore checks too), az:// URLs, and the block path (each write one staged block, the blob
visible only whole, at close; zeros where nothing was written)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import CkptError
from ckptio.io.stage import StagingPool
from ckptio.options import MiB
from ckptio.storage.azure.az_backend import AzureBackend, head
from ckptio.storage.azure.az_client import AzPath
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.azure.az_store import AzureStore
from ckptio.testing.store_conformance import StoreConformance, data_name
from azure_blob.conftest import through


class TestAzureStore(StoreConformance):
    @pytest.fixture
    def store_factory(self, az_env):
        return lambda key: AzureStore(f"{az_env}/{key}", AzureSettings())

    @pytest.fixture
    def refuse_removal(self, az_proxy):
        """Through the proxy, the service answers 403 to deleting ``name``."""

        @contextlib.contextmanager
        def refuse(store: AzureStore, name: str) -> Iterator[None]:
            proxied = AzureStore(store.location, AzureSettings(
                connection_string=through(az_proxy)))
            az_proxy.fail(403, "AuthorizationPermissionMismatch", times=None, method="DELETE",
                          key=re.escape(name))
            store.remove = proxied.remove  # type: ignore[method-assign]
            try:
                yield
            finally:
                az_proxy.clear()
                del store.remove

        return refuse


def test_urls_parse_and_refuse_bad_ones():
    assert AzPath.parse("az://box-1/run/step-3/") == AzPath("box-1", "run/step-3")
    assert AzPath.parse("az://box").url == "az://box"
    for bad in ("az://", "az://B/x", "az://ab/x", "az://a--b/x", "az://box/a//c",
                "az://box/../x", "az:/box/x"):
        with pytest.raises(CkptError):
            AzPath.parse(bad)


def test_writes_are_blocks_committed_whole_at_close(az_env):
    """Each write is staged as it comes (no copy of the file is held); nothing is visible
    until close(sync=True) commits the block list; unwritten ranges read back as zeros, and
    close(sync=False) leaves no blob."""
    settings = AzureSettings()
    backend = AzureBackend(settings, MiB)
    pool = StagingPool(1, 3 * MiB)
    buffer = pool.acquire()
    data = bytes(range(256)) * (2 * MiB // 256)
    buffer.view[:len(data)] = data
    url = f"{az_env}/{data_name()}"
    fh = backend.open_write(url, 3 * MiB + 5)
    for offset in (0, MiB):
        assert backend.submit_write(fh, offset, buffer.view[offset:offset + MiB]).result(60) == MiB
    assert head(settings, AzPath.parse(url)) is None, "a blob appeared before its commit"
    backend.close(fh, sync=True)
    assert head(settings, AzPath.parse(url)) == (3 * MiB + 5, head(settings, AzPath.parse(url))[1])
    back = bytearray(3 * MiB + 5)
    rh = backend.open_read(url)
    assert backend.submit_read(rh, 0, memoryview(back)).result(60) == len(back)
    assert bytes(back[:2 * MiB]) == data and not any(back[2 * MiB:])
    dropped = f"{az_env}/{data_name(1)}"
    fh = backend.open_write(dropped, BLOCK)
    backend.submit_write(fh, 0, buffer.view[:BLOCK]).result(60)
    backend.close(fh, sync=False)
    assert head(settings, AzPath.parse(dropped)) is None
    pool.release(buffer)
    backend.shutdown()


def test_a_tree_is_removed_manifests_first(az_env):
    """remove_tree deletes every manifest before any data blob, so a kill part way leaves no
    committed checkpoint missing its data (object_tree.py's rule, once for gs:// and az://;
    the Azure store deleted its data first before the two shared one core)."""
    root = AzureStore(f"{az_env}/tree", AzureSettings())
    for step in ("step-1", "step-2"):
        store = root.child(step)
        store.write_file(data_name(), b"data")
        store.commit(b"{}", "save")
    deleted: list[str] = []
    delete = root.bucket.delete
    root.bucket.delete = lambda key: (deleted.append(key), delete(key))[1]  # type: ignore[method-assign]
    assert root.remove_tree() == []
    kinds = ["manifest" if key.endswith("/manifest.json") else "data" for key in deleted]
    assert kinds == ["manifest", "manifest", "data", "data"], deleted
    assert root.entries() == []
