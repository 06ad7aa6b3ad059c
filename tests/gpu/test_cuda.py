"""CUDA paths: device tensors saved and loaded back in place on the device. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import ckptio
from ckptio.storage.local.local_store import LocalStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    return {
        "w": torch.randn(1024, 513, generator=g).to(device),
        "wt": torch.randn(300, 700, generator=g).to(device).t(),  # non-contiguous on device
        "h": torch.randn(4096, generator=g).to(device, torch.bfloat16),
        "step": 3,
    }


def test_cuda_tensors_round_trip_fresh_and_in_place(tmp_path):
    options = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)
    src = _state("cuda")
    ckptio.save(src, tmp_path / "c", options=options)
    fresh = ckptio.load(tmp_path / "c", options=options)
    for key in ("w", "wt", "h"):
        assert fresh[key].device.type == "cpu"
        assert torch.equal(fresh[key], src[key].cpu())
    dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in src.items()}
    ckptio.load(tmp_path / "c", dest, options=options)
    for key in ("w", "wt", "h"):
        assert dest[key].device.type == "cuda"
        assert torch.equal(dest[key], src[key])
    assert dest["step"] == 3


def test_pool_is_pinned_with_cuda():
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20))
    pool, _files = ck.resources().files(LocalStore("."))
    assert pool.pinned
    # page-locked as CUDA sees it: every buffer, and the control (ordinary memory) is not
    buffers = [pool.acquire() for _ in range(4)]
    assert [b.data.is_pinned() for b in buffers] == [True] * 4
    assert not torch.empty(1 << 20, dtype=torch.uint8).is_pinned()
    # a non_blocking copy from the device lands in it once the stream is synchronised
    src = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
    dst = buffers[1].data.view(torch.float32)
    dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(dst, src.cpu())
    for b in buffers:
        pool.release(b)
    ck.close()
    assert not pool.pinned


def test_async_save_from_device_then_mutate_on_the_stream(tmp_path):
    """Values produced on the caller's stream just before the save are captured (the side stream
    waits for them); a kernel queued on that stream right after async_save returns does not
    reach the checkpoint (the copies had landed). The state is 8x the pool, so copies stream."""
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20))
    big = torch.zeros(2 << 20, device="cuda")  # 8 MiB
    big.add_(7.0)  # queued, perhaps not yet run, when the save starts
    expected = torch.full((2 << 20,), 7.0)
    handle = ck.async_save({"big": big}, tmp_path / "c")
    big.mul_(0.0)  # queued right after return
    handle.wait()
    assert torch.equal(ckptio.load(tmp_path / "c")["big"], expected)
    ck.close()


def test_lazy_save_of_a_cuda_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=2 << 20))
    handle = ck.async_save(state, tmp_path / "c", lazy=True, optimizers=[opt])
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()  # waits for the capture
    handle.wait()
    loaded = ckptio.load(tmp_path / "c")
    for key, value in before.items():
        assert torch.equal(loaded["model"][key], value), key
    ck.close()


def test_rng_state_round_trips_every_cuda_devices_generator(tmp_path):
    """ckptio.RNGState() captures each visible device's generator and restores each one: the
    same states, byte for byte, and the same draws after the restore."""
    devices = [f"cuda:{d}" for d in range(torch.cuda.device_count())]
    for n, device in enumerate(devices):
        with torch.cuda.device(device):
            torch.cuda.manual_seed(1000 + n)  # a different state on every device
        torch.randn(100 + n, device=device)  # and advanced from its seed
    saved = [s.clone() for s in torch.cuda.get_rng_state_all()]
    assert len(saved) == len(devices)
    ckptio.save({"rng": ckptio.RNGState()}, tmp_path / "c")
    draws = [torch.randn(64, device=device).cpu() for device in devices]
    torch.cuda.manual_seed_all(7)  # every device elsewhere
    assert any(not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), saved))
    stored = ckptio.load(tmp_path / "c")["rng"]["cuda"]
    assert [torch.equal(a, b) for a, b in zip(stored, saved)] == [True] * len(devices)
    ckptio.load(tmp_path / "c", {"rng": ckptio.RNGState()})
    restored = torch.cuda.get_rng_state_all()
    assert [torch.equal(a, b) for a, b in zip(restored, saved)] == [True] * len(devices)
    again = [torch.randn(64, device=device).cpu() for device in devices]
    assert [torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(again, draws)] == [True] * len(devices)


def test_replica_digests_of_device_pieces_match_their_host_bytes():
    """Keys on disjoint meshes are told apart by an xxh3 of each rank's piece: a device piece
    (non-contiguous, bf16, empty) must hash as its host copy does, or equal replicas on a GPU
    rank and a CPU rank would be refused as different."""
    from ckptio.distributed.rankplan import _digest

    g = torch.Generator(device="cpu").manual_seed(1)
    host = [torch.randn(64, 48, generator=g).t(), torch.randn(333, generator=g).bfloat16(),
            torch.empty(0, 5), torch.arange(10, dtype=torch.int64)[::3]]
    for h in host:
        assert _digest(h.to("cuda")) == _digest(h.contiguous())
    changed = host[0].clone()
    changed[3, 7] += 1
    assert _digest(changed.to("cuda")) != _digest(host[0])
