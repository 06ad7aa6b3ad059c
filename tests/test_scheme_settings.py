"""Each scheme's settings live with its registry entry (storage/select.py settings_for):
``Options(storage={scheme: settings})`` is the primary spelling, Options' ``s3_*`` fields and
the CKPTIO_S3_* variables the older one that builds the same S3Settings. A new scheme is one
class in the user's file and one register_store line: here a toy scheme, defined in this file
only, saves and loads through ckptio with its own settings and passes the Store conformance
suite (ckptio/testing/store_conformance.py) without any ckptio module knowing it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.options import Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.select import capped, store_for
from ckptio.testing.store_conformance import StoreConformance
from ckptio.tuning import profile

ROOT = Path(__file__).resolve().parents[1]
OPTS = dict(buffer_bytes=1 << 20, pool_bytes=4 << 20)


# -- a scheme of the user's own: its settings, its store, one registry line -----------------------


@dataclasses.dataclass(frozen=True)
class ToySettings:
    """The toy scheme's settings: the directory its locations live under."""

    root: str = "/nonexistent-toyfs-root"
    retry_deadline_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class Quiet:
    """Settings without a retry deadline (capped() leaves them alone)."""

    level: int = 0


class ToyStore(LocalStore):
    """``toyfs://NAME`` is the directory NAME under its settings' root."""

    def __init__(self, location: str, settings: ToySettings) -> None:
        super().__init__(str(Path(settings.root) / location.split("://", 1)[1]))
        self.settings = settings


def _register() -> None:
    ckptio.register_store("toyfs", lambda location, options: ToyStore(
        location, ckptio.settings_for(location, options)), settings=ToySettings, replace=True)


def _options(root: Path | str, **more: object) -> Options:
    return Options(storage={"toyfs": ToySettings(root=str(root))}, **OPTS, **more)  # type: ignore[arg-type]


def test_a_toy_scheme_saves_and_loads_with_its_own_settings(tmp_path: Path) -> None:
    _register()
    state = {"w": torch.randn(300, 70), "step": 7}
    ckptio.save(state, "toyfs://run/step-7", options=_options(tmp_path / "a"))
    assert (tmp_path / "a" / "run" / "step-7" / "manifest.json").is_file()
    got = ckptio.load("toyfs://run/step-7", options=_options(tmp_path / "a"))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7
    as_mapping = Options(storage={"toyfs": {"root": str(tmp_path / "a")}}, **OPTS)  # type: ignore[arg-type]
    assert ckptio.settings_for("toyfs://run", as_mapping) == ToySettings(str(tmp_path / "a"))
    assert torch.equal(ckptio.load("toyfs://run/step-7", options=as_mapping)["w"], state["w"])
    with pytest.raises(ckptio.CheckpointNotFoundError):  # other settings: another root
        ckptio.load("toyfs://run/step-7", options=_options(tmp_path / "b"))
    assert ckptio.settings_for("toyfs://x", Options()) == ToySettings()  # none given: defaults
    assert ckptio.settings_for(tmp_path, _options(tmp_path)) is None  # a local path has none


def test_the_toy_scheme_refuses_what_is_not_its_settings(tmp_path: Path) -> None:
    _register()
    for storage, phrase in (({"toyfs": {"rot": "x"}}, "'rot'"),
                            ({"toyfs": 3}, "give a ToySettings"),
                            ({"toyf": ToySettings()}, "no registered scheme toyf://")):
        with pytest.raises(ckptio.CkptError, match=phrase):
            ckptio.save({"a": torch.ones(2)}, "toyfs://r/s", options=Options(storage=storage))
    with pytest.raises(ckptio.CkptError, match="settings' class"):
        ckptio.register_store("toyfs", lambda location, options: ToyStore(location, ToySettings()),
                              settings=ToySettings(), replace=True)  # type: ignore[arg-type]


class TestToySchemeStore(StoreConformance):
    """The Store conformance suite on the toy scheme, every store made through the registry."""

    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Callable[[str], object]:
        _register()
        return lambda key: store_for(f"toyfs://{key}", _options(tmp_path))


# -- the deadline a manager caps for a slower tier's listing, for any scheme's settings ----------


def test_capped_lowers_any_schemes_retry_deadline(tmp_path: Path) -> None:
    _register()
    quick = capped("toyfs://run", _options(tmp_path), 10.0)
    assert ckptio.settings_for("toyfs://run", quick) == ToySettings(str(tmp_path), 10.0)
    s3 = Options(storage={"s3": ckptio.S3Settings(retry_deadline_s=90)})
    assert ckptio.settings_for("s3://b/p", capped("s3://b/p", s3, 10.0)).retry_deadline_s == 10.0
    old = Options(s3_retry_deadline_s=90, s3_region="eu-x")
    got = ckptio.settings_for("s3://b/p", capped("s3://b/p", old, 10.0))
    assert (got.retry_deadline_s, got.region) == (10.0, "eu-x")
    ckptio.register_store("quietfs", lambda location, options: ToyStore(
        location, ToySettings(str(tmp_path))), settings=Quiet, replace=True)
    plain = Options(storage={"quietfs": Quiet(2)})
    assert capped("quietfs://x", plain, 10.0) is plain


# -- S3: two spellings of one settings object --------------------------------------------------


def test_the_s3_fields_and_the_s3_settings_are_one_thing() -> None:
    old = Options(s3_endpoint_url="http://127.0.0.1:9", s3_concurrency=4, s3_read_bytes=1 << 20)
    new = Options(storage={"s3": ckptio.S3Settings(endpoint_url="http://127.0.0.1:9",
                                                   concurrency=4, read_bytes=1 << 20)})
    assert ckptio.settings_for("s3://b/p", old) == ckptio.settings_for("s3://b/p", new)
    with pytest.raises(ckptio.CkptError, match=r"storage\['s3'\] and s3_region"):
        Options(storage={"s3": ckptio.S3Settings()}, s3_region="eu-x")
    with pytest.raises(ckptio.CkptError, match="S3Settings.concurrency=0"):
        ckptio.S3Settings(concurrency=0)
    with pytest.raises(ckptio.CkptError, match="Options.s3_concurrency=0"):
        Options(s3_concurrency=0)


def test_the_environment_still_builds_the_s3_settings() -> None:
    """A user's fresh process: CKPTIO_S3_* variables, Options.from_env(), settings_for."""
    code = ("import ckptio; from ckptio.options import Options; "
            "s = ckptio.settings_for('s3://b/p', Options.from_env()); "
            "print(s.endpoint_url, s.lock_lease_s)")
    env = {"PYTHONPATH": str(ROOT), "CKPTIO_S3_ENDPOINT_URL": "http://127.0.0.1:9",
           "CKPTIO_S3_LOCK_LEASE_S": "5", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == ["http://127.0.0.1:9", "5.0"], done.stderr


def test_an_endpoints_profile_tunes_the_s3_settings_left_at_their_defaults() -> None:
    endpoint = "http://tuned-endpoint.invalid:9"
    profile.store(profile.S3Profile(endpoint, 3, 6 << 20, "2026-11-24T00:00:00Z", 0.1, 0.2,
                                    io_depth=5, read_bytes=2 << 20))
    for options, want in ((Options(), (3, 2 << 20, 5)),
                          (Options(storage={"s3": ckptio.S3Settings(concurrency=7)}),
                           (7, 2 << 20, 5)),
                          (Options(s3_concurrency=7, io_depth=2), (7, 2 << 20, 2))):
        tuned = profile.tuned_s3_options(options, endpoint)
        settings = ckptio.settings_for("s3://b/p", tuned)
        assert (settings.concurrency, settings.read_bytes, tuned.io_depth) == want, options
        assert settings.read_concurrency == 2 * tuned.io_depth
