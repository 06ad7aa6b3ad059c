"""ckptio.save / async_save / load / verify on s3:// paths, as users call them, against a real
SeaweedFS server: a real model and optimizer resumed in place, lazy saves, damage found,
partial loads reading only their ranges, gloo ranks resharding, two savers racing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptio
from ckptio.storage.select import store_for
from ckptio.storage.s3.s3path import S3Path
from ckptio.testing.rank_processes import run_ranks

import dist_cases as cases
from s3.s3_models import build, train

SMALL = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20)


RESUME = textwrap.dedent("""
    import sys, torch, ckptio
    sys.path.insert(0, sys.argv[2])
    from s3_models import build, train
    model, opt, sched = build()
    ckptio.load(sys.argv[1], {"model": model, "opt": opt, "sched": sched,
                              "rng": ckptio.RNGState(), "step": 0})
    train(model, opt, sched, 3)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[3])
""")


def test_a_training_job_resumes_in_a_fresh_process_bitwise(s3_env, tmp_path):
    model, opt, sched = build()
    train(model, opt, sched, 3)
    url = f"{s3_env}/run/step-3"
    ckptio.save({"model": model, "opt": opt, "sched": sched, "rng": ckptio.RNGState(),
                 "step": 3}, url)
    train(model, opt, sched, 3)  # the uninterrupted run
    out = tmp_path / "resumed.pt"
    subprocess.run([sys.executable, "-c", RESUME, url, os.path.dirname(__file__), str(out)],
                   check=True, env=os.environ.copy(), timeout=120)
    resumed = torch.load(out)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed[key], value), key


def test_async_and_lazy_saves_commit_and_load(s3_env):
    model, opt, sched = build()
    train(model, opt, sched, 1)
    checkpointer = ckptio.Checkpointer(SMALL)
    handle = checkpointer.async_save({"model": model, "opt": opt}, f"{s3_env}/async")
    result = handle.wait()
    assert result.nbytes > 0 and result.path == f"{s3_env}/async"
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    handle = checkpointer.async_save({"model": model, "opt": opt}, f"{s3_env}/lazy", lazy=True,
                                     optimizers=[opt])
    opt.step()  # waits for the capture of the values before the step
    handle.wait()
    loaded = checkpointer.load(f"{s3_env}/lazy")
    for key, value in expected.items():
        assert torch.equal(loaded["model"][key], value), key
    checkpointer.close()


def test_damage_is_found_by_verify_and_load(s3_env, s3_client):
    url = f"{s3_env}/damaged"
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}
    ckptio.save(state, url, options=SMALL)
    store = store_for(url)
    (name,) = store.names()
    where = S3Path.parse(store.path_of(name))
    body = bytearray(s3_client.get_object(Bucket=where.bucket, Key=where.key)["Body"].read())
    body[12345] ^= 1
    s3_client.delete_object(Bucket=where.bucket, Key=where.key)
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=bytes(body))
    with pytest.raises(ckptio.CorruptCheckpointError, match="w"):
        ckptio.verify(url)
    with pytest.raises(ckptio.CorruptCheckpointError):
        ckptio.load(url, {"w": torch.zeros(3 << 20)})


def test_a_partial_load_reads_only_its_ranges(s3_server, s3_proxy, s3_env):
    url = f"{s3_env}/partial"
    big = {f"layer{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    ckptio.save({**big, "small": torch.arange(10.0)}, url, options=SMALL)
    options = ckptio.Options(buffer_bytes=5 << 20, pool_bytes=20 << 20,
                             s3_endpoint_url=s3_proxy.endpoint)
    s3_proxy.range_bytes = 0
    out = {"small": torch.zeros(10)}
    report = ckptio.load(url, out, keys="small", options=options)
    assert torch.equal(out["small"], torch.arange(10.0)) and report.loaded == ("small",)
    assert 0 < s3_proxy.range_bytes <= 2 << 20, s3_proxy.range_bytes  # one checksum block
    full = ckptio.load(url, options=options)
    assert torch.equal(full["layer3"], big["layer3"])
    assert s3_proxy.range_bytes >= 32 << 20


@pytest.mark.parametrize("saved_as,loaded_on,loaded_as", [("shard0", 3, "flat"),
                                                          ("mesh2d", 1, "full")])
def test_ranks_save_and_reshard_through_s3(s3_server, s3_env, saved_as, loaded_on, loaded_as):
    url = f"{s3_env}/ranks-{saved_as}"
    env = s3_server.env()
    run_ranks(4 if saved_as == "mesh2d" else 2, cases.s3_save_layout, env, url, saved_as)
    run_ranks(loaded_on, cases.s3_load_layout, env, url, loaded_as)


def test_a_second_saver_with_if_locked_raise_is_refused_and_nothing_mixes(s3_env):
    # a saver that waits for the holder, and the lease renewed meanwhile: test_lock_s3.py
    url = f"{s3_env}/contended"
    ckptio.save({"w": torch.zeros(4)}, url)
    first = store_for(url)
    claim = first.exclusive("raise")
    try:
        refusing = ckptio.Checkpointer(ckptio.Options(if_locked="raise"))
        with pytest.raises(ckptio.CheckpointLockedError, match="another save"):
            refusing.save({"w": torch.ones(4)}, url)
    finally:
        claim.release()
    assert torch.equal(ckptio.load(url)["w"], torch.zeros(4))
    ckptio.save({"w": torch.ones(4)}, url)
    assert torch.equal(ckptio.load(url)["w"], torch.ones(4))


def test_a_location_that_is_not_a_checkpoint_says_what_it_holds(s3_env, s3_client):
    with pytest.raises(ckptio.CheckpointNotFoundError, match="nothing is stored"):
        ckptio.load(f"{s3_env}/nothing")
    ckptio.save({"w": torch.zeros(4)}, f"{s3_env}/parent/step-1")
    with pytest.raises(ckptio.CheckpointNotFoundError, match="step-1"):
        ckptio.load(f"{s3_env}/parent")
    where = S3Path.parse(f"{s3_env}/dcp/__0_0.distcp")
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"x")
    with pytest.raises(ckptio.CheckpointNotFoundError, match="DCP.*no .metadata"):
        ckptio.load(f"{s3_env}/dcp")
    # with a .metadata it is read as a DCP checkpoint (tests/s3/test_dcp_s3.py): this one is not
    where = S3Path.parse(f"{s3_env}/dcp/.metadata")
    s3_client.put_object(Bucket=where.bucket, Key=where.key, Body=b"x")
    with pytest.raises(ckptio.ManifestError, match="dcp/.metadata: .*DCP metadata is damaged"):
        ckptio.load(f"{s3_env}/dcp")
