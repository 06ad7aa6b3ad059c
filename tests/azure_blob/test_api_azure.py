"""az:// through ckptio's public API against a real Azurite server, as users run it: the
account from $AZURE_STORAGE_CONNECTION_STRING and default Options; ckptio.save then
ckptio.load (bitwise) in a fresh process; a CheckpointManager that keeps two steps and
restores the newest in a fresh process; the StepRoot conformance suite with its faults through
the proxy (the marker's Put denied: hide refused; Delete Blob denied: removal failing)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

import ckptio
from ckptio.storage.azure.az_root import MARKER, AzureRoot
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.azure.az_store import AzureStore
from ckptio.storage.steproot import StepRoot
from ckptio.testing.s3proxy import FaultProxy
from ckptio.testing.steproot_conformance import Roots, StepRootConformance, commit_by_store

from azure_blob.conftest import through

LOAD = textwrap.dedent("""
    import sys, torch, ckptio
    state = {"w": torch.zeros(1000, 300), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    ckptio.load(sys.argv[1], state)
    torch.save(state, sys.argv[2])
""")


def _state(step: int) -> dict[str, object]:
    return {"w": torch.randn(1000, 300), "b": torch.arange(7) + step, "step": step}


def test_save_then_load_in_a_fresh_process(az_env, tmp_path):
    url = f"{az_env}/ckpt"
    state = _state(3)
    ckptio.save(state, url)
    assert ckptio.verify(url) > 0
    out = tmp_path / "loaded.pt"
    subprocess.run([sys.executable, "-c", LOAD, url, str(out)], check=True,
                   env=os.environ.copy(), timeout=180)
    got = torch.load(out)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert got["step"] == 3


RESTORE = textwrap.dedent("""
    import sys, torch, ckptio
    state = {"w": torch.zeros(1000, 300), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    with ckptio.CheckpointManager(sys.argv[1], keep_last=2) as mgr:
        steps, restored = mgr.steps(), mgr.restore(state)
    torch.save({"steps": steps, "restored": restored, "state": state}, sys.argv[2])
""")


def test_a_manager_keeps_two_steps_and_restores_the_newest_in_a_fresh_process(az_env, tmp_path):
    url = f"{az_env}/run"
    with ckptio.CheckpointManager(url, keep_last=2) as mgr:
        for step in range(1, 5):
            state = _state(step)
            mgr.save(step, state, asynchronous=step % 2 == 0)
    assert AzureStore(url, AzureSettings()).entries() == ["step-3", "step-4"]
    out = tmp_path / "restored.pt"
    subprocess.run([sys.executable, "-c", RESTORE, url, str(out)], check=True,
                   env=os.environ.copy(), timeout=180)
    got = torch.load(out)
    assert got["steps"] == [3, 4] and got["restored"] == 4
    assert torch.equal(got["state"]["w"], state["w"]) and got["state"]["step"] == 4


def _store(location: str) -> AzureStore:
    return AzureStore(location, AzureSettings())


def _denied(proxy: FaultProxy, **match: object) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def denied() -> Iterator[None]:
        proxy.fail(403, "AuthorizationPermissionMismatch", times=None, **match)
        try:
            yield
        finally:
            proxy.clear()

    return denied()


class TestAzureRoot(StepRootConformance):
    @pytest.fixture
    def roots(self, az_env, az_proxy) -> Roots:
        """Roots reached through the proxy (so faults can be injected); stores straight."""
        proxied = AzureSettings(connection_string=through(az_proxy))
        return Roots(make=lambda key: AzureRoot(f"{az_env}/{key}", proxied), store_at=_store,
                     commit=commit_by_store(_store))

    @pytest.fixture
    def refuse_hide(self, az_proxy):
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            key = re.escape(f"step-{step}/{MARKER}") + "$"
            return _denied(az_proxy, method="PUT", key=key)

        return refuse

    @pytest.fixture
    def refuse_removal(self, az_proxy):
        def refuse(root: StepRoot, step: int) -> contextlib.AbstractContextManager[None]:
            return _denied(az_proxy, method="DELETE")

        return refuse


KILLED = textwrap.dedent("""
    import os, signal, sys
    from ckptio.storage.azure.az_settings import AzureSettings
    from ckptio.storage.azure.az_store import AzureStore
    AzureStore(sys.argv[1], AzureSettings()).exclusive("raise")
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lease, which nothing renews
""")


def test_a_killed_savers_lock_is_taken_over_at_once_and_a_live_one_is_refused(az_env, caplog):
    """A save SIGKILLed while it held the claim leaves its lease; a save on this host sees the
    holder's process is gone and takes the lock over at once (not after the lease), saying so;
    while a live save holds it, another is refused naming the holder."""
    url = f"{az_env}/killed"
    ran = subprocess.run([sys.executable, "-c", KILLED, url], env=os.environ.copy(), timeout=120)
    assert ran.returncode == -9
    store = AzureStore(url, AzureSettings())
    claim = store.exclusive("raise")
    try:
        assert "took over the lock" in caplog.text and "has exited" in caplog.text
        with pytest.raises(ckptio.CheckpointLockedError, match=f"pid {os.getpid()}"):
            AzureStore(url, AzureSettings()).exclusive("raise")
    finally:
        claim.release()
    ckptio.save({"w": torch.ones(3)}, url)  # released: the lock is free again
