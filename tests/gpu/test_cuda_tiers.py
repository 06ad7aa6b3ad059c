"""A manager's memory tier fed from the device: the mapped save (issue 45's "one copy into the
memory tier") with CUDA sources, whose tmpfs pages are page-locked once (cudaHostRegister) and
are the device->host copies' target. Skipped without CUDA.

Covers: eager async saves of a device state into ``shm://`` every step; once the ring of
keep_last + 1 is warm each step's data files are a dropped step's (the mapped way, not the
pool), kernels queued on the caller's stream right after the call do not reach the checkpoint,
every kept step verifies and loads back bit for bit onto the device with no stale bytes; lazy
saves of a CUDA model and fused AdamW with ``after_step`` capture the pre-step values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckptio
from ckptio import Tier
from tests.test_mapped_save import OPTS, _assert_no_stale_bytes, _inodes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _device_state(step: int) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(step)
    return {"w": torch.randn(700_001, generator=g).cuda(),
            "h": torch.randn(333, 77, generator=g).cuda().to(torch.bfloat16).t(),
            "i": torch.randint(0, 1 << 30, (4097,), generator=g).cuda(),
            "step": step}


def test_device_saves_into_the_memory_tier_land_in_reused_pages(shm):
    keep_last = 2
    removed: set[int] = set()
    expected: dict[int, dict[str, Any]] = {}
    with ckptio.CheckpointManager(tiers=[Tier("shm://gpu", keep_last=keep_last)],
                                  options=OPTS) as mgr:
        inodes: dict[int, set[int]] = {}
        for step in range(keep_last + 4):
            state = _device_state(step)
            expected[step] = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in state.items()}
            handle = mgr.save(step, state, asynchronous=True)
            assert handle is not None
            for key in ("w", "h", "i"):  # queued right after the call: not in the checkpoint
                state[key].zero_()
            handle.wait()
            inodes[step] = _inodes(mgr.path(step))
            if step > keep_last:
                removed |= inodes[step - keep_last - 1]
                assert inodes[step] and inodes[step] <= removed, "not saved into reused pages"
        for step in mgr.steps():
            ckptio.verify(mgr.path(step))
            _assert_no_stale_bytes(mgr.path(step))
            dest = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0)
                    for k, v in _device_state(step).items()}
            ckptio.load(mgr.path(step), dest)
            for key, want in expected[step].items():
                if isinstance(want, torch.Tensor):
                    assert dest[key].is_cuda and torch.equal(dest[key].cpu(), want), key
                else:
                    assert dest[key] == want


def test_lazy_device_saves_with_after_step_keep_the_pre_step_values(shm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(32, 256, device="cuda")
    with ckptio.CheckpointManager(tiers=[Tier("shm://gpu-lazy", keep_last=2)],
                                  options=OPTS) as mgr:
        saved: dict[int, dict[str, torch.Tensor]] = {}
        for step in range(6):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            saved[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            handle = mgr.save(step, state, lazy=True, optimizers=[opt], after_step=[model])
            assert handle is not None
            model(x).square().mean().backward()  # the next step's work, then its update
            opt.step()
            opt.zero_grad()
            handle.wait()
        for step in mgr.steps():
            ckptio.verify(mgr.path(step))
            loaded = ckptio.load(mgr.path(step))
            for key, want in saved[step].items():
                assert torch.equal(loaded["model"][key], want), (step, key)


def test_prepare_makes_and_page_locks_the_first_saves_slots(shm):
    """prepare(state, wait=True) with a device state: the memory tier's slots for the first
    saves are made, mapped and page-locked ahead, so the first save copies into them
    (non_blocking copies; a kernel queued right after the call does not reach the checkpoint)
    and loads back bit for bit."""
    import os

    from ckptio.storage.local.mapped import borrow, release
    from ckptio.storage.local.slots import SLOTS_DIR
    from ckptio.storage.select import checkpoint_path

    with ckptio.CheckpointManager(tiers=[Tier("shm://gpu-ahead", keep_last=2)],
                                  options=OPTS) as mgr:
        mgr.prepare(_device_state(0), wait=True)
        slots = os.path.join(checkpoint_path("shm://gpu-ahead"), SLOTS_DIR)
        names = sorted(os.listdir(slots))
        assert names and all(n.startswith("prepared.") for n in names), names
        for name in names:
            entry = borrow(os.path.join(slots, name))
            assert entry is not None and entry.kept.get("pinned"), f"{name} not page-locked"
            release(entry)
        prepared = {os.stat(os.path.join(slots, n)).st_ino for n in names}
        state = _device_state(0)
        expected = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in state.items()}
        handle = mgr.save(0, state, asynchronous=True)
        assert handle is not None
        for key in ("w", "h", "i"):
            state[key].zero_()
        handle.wait()
        assert _inodes(mgr.path(0)) <= prepared, "the first save did not take a prepared slot"
        loaded = ckptio.load(mgr.path(0))
        for key, want in expected.items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(loaded[key], want), key
        _assert_no_stale_bytes(mgr.path(0))
