"""The checkpoint I/O study (ckptio bench io) in a tiny configuration, on real files."""

from __future__ import annotations

import json
import math
import mmap
import os

import pytest

from ckptio import cli
from ckptio.tuning import io_study
from ckptio.tuning import state
from ckptio.alignment import BLOCK
from ckptio.tuning.io_study import Cell, build_plan

KiB = 1 << 10


def direct_io_works(directory) -> bool:
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        os.pwrite(fd, mmap.mmap(-1, BLOCK), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(directory / "probe")


def tiny_argv(data, out, modes: str) -> list[str]:
    return [str(data), "--total", "256K", "--sizes", "64K,128K", "--pool-depths", "2",
            "--uring-depths", "2", "--reps", "1", "--idle", "0", "--align-sizes", "64K",
            "--layout-sizes", "64K", "--extend-sizes", "128K", "--mix-chunk", "128K",
            "--modes", modes, "--out", str(out / "io")]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """One tiny study through the command line, in a directory holding a file of the user's."""
    root = tmp_path_factory.mktemp("study")
    data, out = root / "data", root / "out"
    data.mkdir()
    (data / "keep.txt").write_text("not ours")
    modes = "direct,buffered" if direct_io_works(data) else "buffered"
    argv = tiny_argv(data, out, modes)
    rc = cli.main(["bench", "io", *argv])
    doc = json.loads((out / "io.json").read_text())
    return {"rc": rc, "doc": doc, "data": data, "out": out, "argv": argv}


def test_study_runs_every_expected_cell_once(study):
    doc = study["doc"]
    config = io_study.config_from(io_study.parse_args(study["argv"]))
    want = {tuple(vars(c).values()) for c in io_study.make_cells(config, doc["meta"]["engines"])}
    got = [tuple(r[k] for k in Cell.__dataclass_fields__) for r in doc["runs"]]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    assert {"posix1", "posix_pool"} <= set(doc["meta"]["engines"])
    assert {c.workload for c in io_study.make_cells(config, ["posix1"])} == {"equal", "gpt"}


def test_study_throughputs_are_finite_and_positive(study):
    doc = study["doc"]
    assert study["rc"] == 0, [r.get("error") for r in doc["runs"] if "error" in r]
    for run in doc["runs"]:
        for key in ("write_gbps", "read_gbps"):
            assert math.isfinite(run[key]) and run[key] > 0, run
    for row in doc["summary"]["rows"]:
        assert row["write_gbps"] > 0 and row["read_gbps"] > 0
    ceiling = doc["summary"]["ceiling"]
    assert ceiling["write_gbps"] > 0 and ceiling["read_gbps"] > 0


def test_study_never_runs_unaligned_o_direct(study):
    runs = study["doc"]["runs"]
    assert not [r for r in runs if r["mode"] == "direct" and not r["aligned"]]
    assert any(not r["aligned"] for r in runs)
    assert "n/a" in (study["out"] / "io.md").read_text()


def test_study_deletes_its_scratch_files_only(study):
    assert sorted(p.name for p in study["data"].iterdir()) == ["keep.txt"]


def test_study_writes_plots_when_matplotlib_is_there(study):
    pytest.importorskip("matplotlib")
    for name in ("sizes", "layout", "mix"):
        assert (study["out"] / f"io_{name}.png").stat().st_size > 0


def test_study_removes_a_directory_it_created(tmp_path):
    data = tmp_path / "new"
    argv = [*tiny_argv(data, tmp_path, "buffered"), "--sections", "sweep", "--engines", "posix1"]
    assert io_study.main(argv) == 0
    assert not data.exists()


def test_gpt_sizes_are_the_bench_state_without_building_it():
    sizes = io_study.gpt_sizes(50 * 10**6)
    cfg = state.gpt_config(0.05)
    assert sum(sizes) == state.state_nbytes(cfg)
    assert len(sizes) == 4 * cfg.n_param_tensors + 1
    assert sum(n < 64 * KiB for n in sizes) > len(sizes) // 2  # many small tensors


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_aggregated_plan_puts_tensors_at_aligned_offsets(mode):
    sizes = [4, 3000, 70000, 1 << 20]
    plan = build_plan(sizes, Cell("gpt", "aggregated", "posix1", 1, mode, 256 * KiB))
    reqs = plan.files[0].reqs
    assert len(plan.files) == 1 and plan.payload_nbytes == sum(sizes)
    assert [r.offset for r in reqs][:3] == [0, BLOCK, 2 * BLOCK]
    if mode == "direct":
        assert all(r.offset % BLOCK == 0 and r.nbytes % BLOCK == 0 for r in reqs)
    assert max(r.nbytes for r in reqs) == 256 * KiB


def test_coalesced_and_per_tensor_and_unaligned_plans():
    sizes = [BLOCK * 3] * 10
    coalesced = build_plan(sizes, Cell("gpt", "coalesced", "posix1", 1, "direct", 8 * BLOCK))
    assert [r.nbytes for r in coalesced.files[0].reqs] == [8 * BLOCK] * 3 + [6 * BLOCK]
    per_tensor = build_plan(sizes, Cell("equal", "file_per_tensor", "posix1", 1, "buffered",
                                        3 * BLOCK))
    assert len(per_tensor.files) == 10 and all(len(f.reqs) == 1 for f in per_tensor.files)
    shifted = build_plan(sizes, Cell("equal", "aggregated", "posix1", 1, "buffered", 3 * BLOCK,
                                     aligned=False))
    assert all(r.offset % BLOCK == 1 and r.buf_offset == 1 for r in shifted.files[0].reqs)


def test_parse_nbytes():
    assert [io_study.parse_nbytes(s) for s in ("64K", "1M", "1.5G", "4096", "16MiB")] == [
        64 * KiB, 1 << 20, 3 << 29, 4096, 16 << 20]
