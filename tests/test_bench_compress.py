"""The compression study and benchmark (benchmarks.compress_study, benchmarks.compress) at tiny
size: a real mixed-precision trajectory, every codec round-tripping real frames, the benchmark's
fresh workers saving and cold-loading through each engine that runs here, bitwise checked.
No timing is asserted: only that every number is there and sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import compress, compress_codecs, compress_engines, compress_study, compress_traj

TINY = ["--preset", "tiny", "--ks", "1,2", "--saves", "2", "--start", "2", "--reps", "1",
        "--idle", "0", "--lora-base-steps", "2"]


def test_trajectory_is_mixed_precision_and_lora_freezes_the_base() -> None:
    full, info = compress_traj.trajectory("full", [1, 2], "tiny")
    assert {t.dtype for t in full[2]["weights"].values()} == {torch.bfloat16}
    for cls in ("master", "exp_avg", "exp_avg_sq"):
        assert {t.dtype for t in full[2][cls].values()} == {torch.float32}
        assert full[2][cls].keys() == full[2]["master"].keys()
    name = "blocks.0.attn.qkv.weight"  # bf16 weights are the fp32 masters rounded
    assert torch.equal(full[2]["weights"][name], full[2]["master"][name].bfloat16())
    assert not torch.equal(full[1]["master"][name], full[2]["master"][name])
    lora, linfo = compress_traj.trajectory("lora", [1, 2], "tiny", base_steps=2)
    assert 0 < linfo["trainable"] < info["trainable"] / 10
    frozen = [k for k in lora[1]["weights"] if "lora_" not in k]
    assert frozen and all(torch.equal(lora[1]["weights"][k], lora[2]["weights"][k])
                          for k in frozen)
    assert set(lora[2]["master"]) == {k for k in lora[2]["weights"] if "lora_" in k}
    assert compress_traj.tensor_class("exp_avg_sq.blocks.0.ln1.weight") == "exp_avg_sq"


def test_every_codec_round_trips_real_frames() -> None:
    snaps, _ = compress_traj.trajectory("full", [1], "tiny")
    for codec in compress_codecs.available():
        for cls in ("weights", "master"):
            row = compress_study.measure(codec, snaps[1][cls], reps=1)  # raises unless exact
            assert row["ratio"] > 0.9 and row["compress_gbs"] > 0, (codec.name, cls, row)


def test_study_reports_every_class_and_k(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")  # the study's codecs (ckptio's compress extra has it)
    out = tmp_path / "study.json"
    assert compress_study.main(["--preset", "tiny", "--start", "2", "--ks", "1,3", "--reps",
                                "1", "--runs", "full,lora", "--lora-base-steps", "2",
                                "--codecs", "zstd-1,bg+zstd-1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    full = {(r["class"], r["data"], r["codec"]): r for r in rows if r["run"] == "full"}
    for cls in compress_traj.CLASSES:
        for data in ("state", "xor 1", "xor 3"):
            assert (cls, data, "bg+zstd-1") in full
    assert full[("weights", "state", "bg+zstd-1")]["ratio"] > 1.1  # bf16's exponent plane
    assert full[("master", "xor 1", "zstd-1")]["elements_identical"] < 0.01
    lora = [r for r in rows if r["run"] == "lora" and r["class"] == "weights"
            and r["data"] == "xor 1"]
    assert lora and lora[0]["tensor_bytes_unchanged"] > 0.9  # the frozen base


def run_bench(tmp_path: Path, extra: list[str]) -> dict:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    argv = [*TINY, "--dir", str(tmp_path / "scratch"), "--json", str(out), "--markdown",
            str(md), *extra]
    assert compress.main(argv) == 0
    assert "### Targets" in md.read_text()
    return json.loads(out.read_text())


def test_benchmark_runs_every_local_engine(tmp_path: Path) -> None:
    engines = [e for e in compress_engines.ENGINES
               if compress_engines.unavailable_reason(e, "local") is None]
    assert {"ckptio_off", "dcp", "torch_save"} <= set(engines)
    result = run_bench(tmp_path, ["--stores", "local", "--engines", ",".join(engines)])
    rows = result["summary"]["rows"]
    assert {(r["engine"], r["run"], r["k"]) for r in rows} == {
        (e, run, k) for e in engines for run in ("full", "lora") for k in (1, 2)}
    for r in rows:
        assert r["bitwise_ok"] is True, r
        assert r["first_stored"] > 0 and r["later_stored"] > 0
        assert all(math.isfinite(r[f]) and r[f] > 0 for f in ("first_save_s", "later_save_s",
                                                              "load_s"))
    by = {(r["engine"], r["run"], r["k"]): r for r in rows}
    off = by[("ckptio_off", "full", 1)]
    assert sum(v["logical"] for v in off["classes_later"].values()) == off["logical"]
    if "dcp_zstd" in engines:  # needs zstandard
        assert by[("dcp_zstd", "full", 1)]["later_stored"] < by[("dcp", "full", 1)]["later_stored"]
    lora_full = by[("ckptio_off", "lora", 1)]["first_stored"]
    if ("ckptio_codec", "full", 1) in by:  # issue 28's engine (needs zstandard)
        assert by[("ckptio_codec", "full", 1)]["later_stored"] < off["later_stored"]
        base = by[("ckptio_base", "lora", 1)]  # a delta references the frozen base
        assert base["later_stored"] < lora_full / 2
        assert base["classes_later"]["weights"]["ref"] > 0
        assert base["classes_later"]["master"]["ref"] == 0  # adapters' masters change
    if ("ckptio_delta", "lora", 1) in by:  # issue 28's manager policy
        assert by[("ckptio_delta", "lora", 1)]["later_stored"] < lora_full / 2
    assert not (tmp_path / "scratch" / "local-r0").exists()  # workers clean up


def test_benchmark_on_the_object_store(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    from ckptio.testing.s3server import ServerError, weed_binary

    try:
        weed_binary()
    except ServerError as exc:
        pytest.skip(f"no weed binary: {exc}")
    result = run_bench(tmp_path, ["--stores", "s3", "--engines", "ckptio_off,dcp",
                                  "--runs", "lora", "--ks", "1"])
    rows = result["summary"]["rows"]
    assert [(r["engine"], r["store"]) for r in rows] == [("ckptio_off", "s3")]
    assert rows[0]["bitwise_ok"] is True and rows[0]["later_stored"] >= rows[0]["logical"]
    assert "dcp on s3" in result["skipped"]
    assert result["summary"]["ceilings"]["s3"]["write_gbs"] > 0
