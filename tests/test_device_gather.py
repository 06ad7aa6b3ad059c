"""The gathered device->host capture (saving/gather.py), its layout logic run on CPU: sources
the test marks eligible take the gathered path (a scratch span zeroed, a foreach copy, one copy
into the buffer), and the files must be byte-for-byte those of the per-tensor capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.saving import gather
from ckptio.saving.gather import DeviceGather


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    state: dict = {"step": 5}
    for i in range(60):  # small ones of every size class, mixed dtypes, between large ones
        n = [1, 3, 17, 64, 1000, 4096, 70_000][i % 7]
        dtype = [torch.float32, torch.bfloat16, torch.int64, torch.float16][i % 4]
        state[f"s{i:02d}"] = (torch.randn(n, generator=g) * 100).to(dtype)
        if i % 13 == 0:
            state[f"big{i:02d}"] = torch.randn(300_000, generator=g)
    state["flag"] = torch.tensor([True, False, True])
    state["scalar"] = torch.tensor(2.5)
    state["empty"] = torch.empty(0, 4)
    state["strided"] = torch.randn(40, 30, generator=g).t()  # not eligible: per-tensor path
    return state


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob("data-*"))}


def _save(path: Path, state: dict, *, lazy: bool) -> None:
    opts = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
    ck = ckptio.Checkpointer(opts)
    try:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])
        ck.async_save(state, str(path), lazy=lazy, optimizers=[opt] if lazy else []).wait()
    finally:
        ck.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_gathered_capture_writes_the_same_bytes_as_per_tensor_copies(tmp_path, monkeypatch,
                                                                     lazy):
    state = _state()
    _save(tmp_path / "plain", state, lazy=lazy)
    calls: list[int] = []
    original = DeviceGather.flush

    def counting_flush(self: DeviceGather) -> None:
        calls.append(len(self._at))
        original(self)

    monkeypatch.setattr(DeviceGather, "eligible", staticmethod(
        lambda s, n: 0 < n <= gather.GATHER_MAX_NBYTES and s.is_contiguous()))
    monkeypatch.setattr(DeviceGather, "flush", counting_flush)
    monkeypatch.setattr(gather, "GATHER_SPAN_NBYTES", 200_000)  # several spans per buffer
    _save(tmp_path / "gathered", state, lazy=lazy)
    assert sum(calls) >= 40 and max(calls) > 5  # many sources per flush: the path was taken
    plain, gathered = _files(tmp_path / "plain"), _files(tmp_path / "gathered")
    assert [len(b) for b in plain.values()] == [len(b) for b in gathered.values()]
    assert list(plain.values()) == list(gathered.values())
    back = ckptio.load(tmp_path / "gathered")
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value), key
