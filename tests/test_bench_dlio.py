"""The DLIO pieces (benchmarks/dlio_ckptio.py, dlio_s3torch.py, dlio_run.py, dlio_setup.sh,
dlio_configs/): the ckptio engine's save_state/load_state against stand-ins for DLIO's base
classes (DLIO lives in its own venv), the per-rank reduction the rules order, the scaled
workload's shape, and that the scripts parse and lint. With DLIO importable, its real classes."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import ckptio
from benchmarks import dlio_run

ROOT = Path(__file__).resolve().parent.parent
FILES = ["benchmarks/dlio_ckptio.py", "benchmarks/dlio_s3torch.py", "benchmarks/dlio_run.py"]


class _Args:
    def __init__(self, folder: Path) -> None:
        self.checkpoint_folder = str(folder)


class _Logger:
    def debug(self, message: str) -> None:
        self.last = message


def _fake_dlio(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """DLIO's two base classes as far as the engines use them: get_name, args, logger."""
    class BaseCheckpointing:
        def __init__(self, ext: str) -> None:
            self.ext, self.args, self.logger = ext, _Args(folder), _Logger()

        def get_name(self, suffix: str) -> str:
            return str(Path(self.args.checkpoint_folder) / f"{suffix}.{self.ext}")

    class PyTorchCheckpointing(BaseCheckpointing):
        def __init__(self) -> None:
            super().__init__("pt")

    base = types.ModuleType("dlio_benchmark.checkpointing.base_checkpointing")
    base.BaseCheckpointing = BaseCheckpointing  # type: ignore[attr-defined]
    pt = types.ModuleType("dlio_benchmark.checkpointing.pytorch_checkpointing")
    pt.PyTorchCheckpointing = PyTorchCheckpointing  # type: ignore[attr-defined]
    for name in ("dlio_benchmark", "dlio_benchmark.checkpointing"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, pt.__name__, pt)
    monkeypatch.delitem(sys.modules, "benchmarks.dlio_ckptio", raising=False)


def test_ckptio_engine_saves_durable_checkpoints_and_loads_into_dlios_tensors(tmp_path, monkeypatch):
    _fake_dlio(monkeypatch, tmp_path)
    engine_module = importlib.import_module("benchmarks.dlio_ckptio")
    engine = engine_module.CkptioCheckpointing.get_instance()
    assert engine is engine_module.CkptioCheckpointing.get_instance()
    state = {"0": {"0": torch.rand(1000, dtype=torch.float16), "1": torch.rand(7)},
             "1": {"0": torch.randint(-128, 128, (33,), dtype=torch.int8)}}
    (tmp_path / "global_epoch1_step1").mkdir()  # DLIO's create_node makes the step folder
    engine.save_state("global_epoch1_step1/zero_pp_rank_0_mp_rank_0_model_states", state, fsync=False)
    path = tmp_path / "global_epoch1_step1" / "zero_pp_rank_0_mp_rank_0_model_states.ckptio"
    ckptio.verify(str(path))  # committed, checksums right, though DLIO passed fsync=False
    saved = {k: {j: t.clone() for j, t in v.items()} for k, v in state.items()}
    targets = [t for v in state.values() for t in v.values()]
    for t in targets:
        t.zero_()
    engine.load_state("global_epoch1_step1/zero_pp_rank_0_mp_rank_0_model_states", state)
    assert [t.data_ptr() for v in state.values() for t in v.values()] == [t.data_ptr() for t in targets]
    for k, v in saved.items():
        for j, t in v.items():
            assert torch.equal(state[k][j], t), (k, j)
    engine_module.CkptioCheckpointing._instance = None


def test_torch_fsync_engine_fsyncs_what_dlios_own_engine_leaves_unsynced(tmp_path, monkeypatch):
    _fake_dlio(monkeypatch, tmp_path)
    engine_module = importlib.import_module("benchmarks.dlio_ckptio")
    synced: list[int] = []
    monkeypatch.setattr(engine_module.os, "fsync", synced.append)
    engine = engine_module.TorchFsyncCheckpointing.get_instance()
    engine.save_state("m", {"a": torch.ones(4)}, fsync=False)
    assert len(synced) == 1
    assert torch.equal(torch.load(tmp_path / "m.pt")["a"], torch.ones(4))
    engine_module.TorchFsyncCheckpointing._instance = None


def test_a_phase_is_the_slowest_rank_per_checkpoint(tmp_path):
    """Duration: the maximum over ranks, each checkpoint apart (and in block order past 9)."""
    per_rank = [{f"save_ckpt{b}": {"duration": d} for b, d in zip(range(1, 12), durations)}
                for durations in ([1.0] * 10 + [5.0], [2.0] * 10 + [3.0])]
    for r, stats in enumerate(per_rank):
        (tmp_path / f"{r}_per_epoch_stats.json").write_text(json.dumps({"1": {"start": "x", **stats}}))
    (tmp_path / "summary.json").write_text(json.dumps({"metric": {"checkpoint_size_GB": 4.0}}))
    phase = dlio_run.read_phase(tmp_path, 2, write=True)
    assert phase["durations_s"] == [2.0] * 10 + [5.0]
    summary = dlio_run.phase_summary(phase)
    assert summary["GBps"] == pytest.approx((10 * 2.0 + 0.8) / 11)  # mean of size / slowest
    assert "| x | 1.891 |" in dlio_run.report([{"engine": "x", "write": summary, "read": summary}])


def test_the_scaled_workload_keeps_llama3_8bs_shape_at_an_eighth_of_its_widths():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "benchmarks/dlio_configs/workload/llama3_8b_scaled.yaml").read_text())
    model = config["model"]
    t = model["transformer"]
    assert (t["hidden_size"] * 8, t["ffn_hidden_size"] * 8, t["vocab_size"] * 8) == (4096, 14336, 128256)
    assert (model["num_layers"], t["num_attention_heads"], t["num_kv_heads"]) == (32, 32, 8)
    assert config["checkpoint"]["fsync"] is True and config["workflow"]["checkpoint"] is True


def test_the_dlio_scripts_parse_and_lint():
    done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks/dlio_setup.sh")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    for file in FILES:
        compile((ROOT / file).read_text(), file, "exec")
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *FILES], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_with_dlio_installed_the_engines_are_its_classes():
    pytest.importorskip("dlio_benchmark", reason="DLIO lives in benchmarks/dlio_setup.sh's venv")
    from dlio_benchmark.checkpointing.base_checkpointing import BaseCheckpointing

    sys.modules.pop("benchmarks.dlio_ckptio", None)  # not the stand-ins' import
    dlio_ckptio = importlib.import_module("benchmarks.dlio_ckptio")
    assert issubclass(dlio_ckptio.CkptioCheckpointing, BaseCheckpointing)
    assert issubclass(dlio_ckptio.TorchFsyncCheckpointing, BaseCheckpointing)
