"""The az:// registry entry and AzureSettings: az:// is a built-in scheme (served, not
replaceable, its store, backend and root the Azure ones); Options.storage["az"] takes the
settings object or a mapping of its fields; values Azure cannot take are refused naming the
field; the endpoint in messages never shows the account key; ``ckptio ls`` and ``ckptio
verify`` read an az:// checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ckptio
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.select import registered_schemes, root_for, scheme_for, settings_for, store_for
from ckptio.testing.azurite import connection_string


def test_az_is_a_built_in_scheme():
    assert "az" in registered_schemes() and scheme_for("az://box/run").backend == "azure"
    assert type(store_for("az://box/run/step-1")).__name__ == "AzureStore"
    assert type(root_for("az://box/run", ckptio.Options())).__name__ == "AzureRoot"
    with pytest.raises(ckptio.CkptError, match="built in"):
        ckptio.register_store("az", lambda location, options: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ckptio.UnsupportedPathError, match="az://"):
        ckptio.save({"w": torch.ones(1)}, "abfs://box/run")  # one spelling: az://


def test_settings_come_from_options_storage():
    given = ckptio.Options(storage={"az": {"retry_deadline_s": 7.0, "concurrency": 3}})
    assert settings_for("az://box/run", given) == AzureSettings(retry_deadline_s=7.0,
                                                               concurrency=3)
    assert settings_for("az://box/run", ckptio.Options()) == AzureSettings()
    for bad in ({"retry_deadline_s": 0}, {"concurrency": 0}, {"lock_lease_s": 90}):
        with pytest.raises(ckptio.CkptError, match=next(iter(bad))):
            AzureSettings(**bad)  # type: ignore[arg-type]


def test_the_endpoint_named_in_messages_hides_the_key():
    settings = AzureSettings(connection_string=connection_string(10000))
    assert settings.endpoint() == "http://127.0.0.1:10000/devstoreaccount1"
    assert "AccountKey" not in store_for(
        "az://box/x", ckptio.Options(storage={"az": settings})).backend_kind
    assert AzureSettings(connection_string="AccountName=acct;AccountKey=k").endpoint() == (
        "https://acct.blob.core.windows.net")


def test_the_command_lists_and_verifies_an_az_checkpoint(az_env):
    url = f"{az_env}/run"
    with ckptio.CheckpointManager(url, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(10)})
    listed = subprocess.run([sys.executable, "-m", "ckptio", "ls", f"{url}/step-1"],
                            capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert listed.returncode == 0 and "w" in listed.stdout, listed.stdout + listed.stderr
    verified = subprocess.run([sys.executable, "-m", "ckptio", "verify", f"{url}/step-1"],
                              capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert verified.returncode == 0 and "OK" in verified.stdout, verified.stdout + verified.stderr


def test_the_command_lists_a_run_on_az(az_env):
    """``ckptio ls az://container/run`` lists the manager's steps, as it does for s3:// runs."""
    url = f"{az_env}/run"
    with ckptio.CheckpointManager(url, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.ones(1000)})
    listed = subprocess.run([sys.executable, "-m", "ckptio", "ls", url],
                            capture_output=True, text=True, env=os.environ.copy(), timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    head, _columns, *rows = listed.stdout.splitlines()
    assert "2 step(s): 2 committed, 0 incomplete" in head, listed.stdout
    assert [row.split()[:2] for row in rows] == [["1", "committed"], ["2", "committed"]]
