"""What a GPU user needs beyond the round trip: a model and AdamW on the device resumed bit-exactly
in a fresh process (same losses), every dtype a device holds, DTensors on one GPU, and loads that
cross devices. Skipped without CUDA (CI has none; docs/BENCH_GPU.md holds the run on a GPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TRAIN = textwrap.dedent(r"""
    import json, os, sys, torch, ckptio
    torch.use_deterministic_algorithms(True)
    mode, path = sys.argv[1], sys.argv[2]

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(256, 64)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    def step(model, opt, sched):
        x = torch.randn(32, 64, device="cuda")       # the CUDA generator drives data and dropout
        loss = (model(x) - x.flip(1)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(); sched.step()
        return loss.item()

    def state(model, opt, sched, n):
        return {"model": model, "optim": opt, "sched": sched, "rng": ckptio.RNGState(), "step": n}

    if mode == "save":
        model, opt, sched = build(0)
        for _ in range(3):
            step(model, opt, sched)
        ckptio.save(state(model, opt, sched, 3), path)
        losses = [step(model, opt, sched) for _ in range(3)]
    else:
        model, opt, sched = build(1)                  # other weights, other RNG, no moments yet
        into = state(model, opt, sched, 0)
        ckptio.load(path, into)
        assert into["step"] == 3
        losses = [step(model, opt, sched) for _ in range(3)]
    weights = {k: v.double().sum().item() for k, v in model.state_dict().items()}
    print(json.dumps({"losses": losses, "weights": weights,
                      "device": str(next(model.parameters()).device)}))
""")


def _run(mode: str, path: str) -> dict:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run([sys.executable, "-c", TRAIN, mode, path], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_model_adamw_scheduler_rng_resume_bit_exactly_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _run("save", path)
    resumed = _run("load", path)
    assert resumed["device"].startswith("cuda")
    assert resumed["losses"] == saved["losses"]  # float equality: the same bits every step
    assert resumed["weights"] == saved["weights"]


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
          torch.bool, torch.complex64)


def _device_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        raw = torch.randn(257, 131, generator=g, device="cuda") * 50
        value = raw.to(torch.complex64) * 1j + raw if dtype.is_complex else raw.to(dtype)
        name = str(dtype).split(".")[1]
        state[name] = value
        state[name + "_t"] = value.t()                      # non-contiguous
        state[name + "_strided"] = value[::3, 1::2]         # gaps between rows and elements
    state["empty"] = torch.empty(0, 7, device="cuda", dtype=torch.bfloat16)
    state["scalar"] = torch.tensor(3.5, device="cuda")
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def test_every_dtype_and_layout_round_trips_fresh_and_in_place_on_the_device(tmp_path):
    src = _device_state()
    ckptio.save(src, tmp_path / "c")
    fresh = ckptio.load(tmp_path / "c")
    for key, value in src.items():
        assert fresh[key].dtype == value.dtype and fresh[key].shape == value.shape, key
    dest = {k: torch.zeros_like(v) for k, v in src.items()}  # transposed ones stay transposed
    dest["float32_view"] = torch.zeros(257 * 3, 131, device="cuda")[::3]  # a view with gaps
    src["float32_view"] = src["float32"]
    strides = {k: v.stride() for k, v in dest.items()}
    ckptio.save(src, tmp_path / "c2")
    ckptio.load(tmp_path / "c2", dest)
    for key, value in src.items():
        assert torch.equal(_bits(fresh.get(key, value)), _bits(value)), key
        assert dest[key].is_cuda and dest[key].stride() == strides[key], key  # filled in place
        assert torch.equal(_bits(dest[key]), _bits(value)), key


def test_loads_cross_devices_both_ways(tmp_path):
    """A checkpoint saved from the device loads into host tensors, and one saved from the host
    loads into device tensors in place (the H2D path), both bit-exact."""
    src = _device_state()
    ckptio.save(src, tmp_path / "from_gpu")
    on_host = {k: torch.zeros_like(v, device="cpu") for k, v in src.items()}
    ckptio.load(tmp_path / "from_gpu", on_host)
    host_src = {k: v.cpu() for k, v in src.items()}
    ckptio.save(host_src, tmp_path / "from_cpu")
    on_device = {k: torch.zeros_like(v) for k, v in src.items()}
    ckptio.load(tmp_path / "from_cpu", on_device)
    for key, value in src.items():
        assert not on_host[key].is_cuda and torch.equal(_bits(on_host[key]), _bits(value)), key
        assert on_device[key].is_cuda and torch.equal(_bits(on_device[key]), _bits(value)), key


DTENSOR = textwrap.dedent(r"""
    import sys, torch, torch.distributed as dist, ckptio
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    g = torch.Generator(device="cuda").manual_seed(3)
    full = torch.randn(96, 40, generator=g, device="cuda")
    src = {"row": distribute_tensor(full, mesh, [Shard(0)]),
           "col": distribute_tensor(full.to(torch.bfloat16), mesh, [Shard(1)]),
           "rep": distribute_tensor(full[:5], mesh, [Replicate()])}
    ckptio.save(src, sys.argv[1])
    dest = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, v.placements)
            for k, v in src.items()}
    ckptio.load(sys.argv[1], dest)
    for k, v in src.items():
        assert dest[k].placements == v.placements, k
        assert dest[k].to_local().is_cuda, k
        assert torch.equal(dest[k].full_tensor(), v.full_tensor()), k
    plain = ckptio.load(sys.argv[1])                  # no destination: the full tensors
    assert torch.equal(plain["row"], full.cpu()) and torch.equal(plain["rep"], full[:5].cpu())
    dist.destroy_process_group()
    print("OK")
""")


def test_dtensors_on_one_gpu_save_and_load_in_place(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", DTENSOR, str(tmp_path / "d"), str(port)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
