"""Red-team checks of the S3 store through the public API, against a real SeaweedFS server
behind the fault proxy: what a demanding user meets when the network fails part way (a store
that stays silent across saves, ...). Each fault ends in a CkptError within a stated time,
commits nothing incomplete, and a later restore gets the last good step."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio.managing.manager import CheckpointManager
from ckptio.storage.s3 import timeouts
from ckptio.testing.s3proxy import FaultProxy

MiB = 1 << 20
DEADLINE_S = 4.0


def _state(seed: int, mib: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def _options(endpoint: str, **changes: Any) -> ckptio.Options:
    settings: dict[str, Any] = {"buffer_bytes": 5 * MiB, "pool_bytes": 20 * MiB,
                                "s3_endpoint_url": endpoint, "s3_retry_deadline_s": DEADLINE_S,
                                "s3_lock_lease_s": 2.0}
    return ckptio.Options(**{**settings, **changes})


def _raises_within(seconds: float, work: Any) -> str:
    began = time.monotonic()
    with pytest.raises(ckptio.StorageIOError) as info:
        work()
    took = time.monotonic() - began
    assert took < seconds, f"failed after {took:.1f} s (bound {seconds} s): {info.value}"
    return str(info.value)


@pytest.fixture
def _fresh_outages() -> Any:
    timeouts.reset()
    yield
    timeouts.reset()


def test_a_store_silent_across_saves_blocks_each_later_async_save_briefly_not_a_deadline(
        s3_env: str, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        _fresh_outages: None) -> None:
    """S3 the only tier, async saves, the store silent from step 2 on: step 2's pre-save
    checks wait out the deadline (nothing tells silence from slowness yet); every later due
    save, the store still silent, is a probe of a tenth of it (at least FLOOR_S), not another
    whole deadline of the training loop. Healed, the next save commits; restore gets it."""
    monkeypatch.setattr(timeouts, "WINDOW_S", 0.5)  # the saves below come after the outage
    run = f"{s3_env}/run"
    manager = CheckpointManager(run, keep_last=2, options=_options(s3_proxy.endpoint))
    manager.save(1, _state(1), asynchronous=True)
    manager.wait()
    s3_proxy.partition()
    _raises_within(DEADLINE_S + 3, lambda: manager.save(2, _state(2), asynchronous=True))
    time.sleep(1.0)
    message = _raises_within(timeouts.FLOOR_S + 1.5,
                             lambda: manager.save(3, _state(3), asynchronous=True))
    assert "no request to it has succeeded since an earlier one gave up" in message, message
    assert f"{run}/step-3" in message and s3_proxy.endpoint in message, message
    s3_proxy.clear()
    time.sleep(1.0)
    manager.save(4, _state(4), asynchronous=True)  # the first answer ends the probes
    manager.close()
    target = _state(0)
    assert CheckpointManager(run, keep_last=2, options=_options(s3_proxy.endpoint)).restore(
        target) == 4
    assert torch.equal(target["w"], _state(4)["w"])
