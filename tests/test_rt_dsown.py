"""ckptio.deepspeed_engine against DeepSpeed's own checkpoint tests (tests/unit/checkpoint,
run by dev/deepspeed_own_tests.sh): what passed there with DeepSpeed's engine and failed with
ckptio's, on a real DeepSpeed engine (CPU accelerator, two gloo ranks).

ZeRO-3's ``load_checkpoint(load_optimizer_states=False)`` (and with ``load_module_only``):
DeepSpeed 0.19.8 rebuilds the weights with its zero_to_fp32, which calls ``torch.load`` on
every rank's files itself; ckptio refused it (DeepSpeed's test_not_load_optimizer_state[3],
test_load_module_only[3], test_immediate_save_load[3], ...). Now those files are read through
ckptio and the weights load bitwise, with zero_to_fp32's torch put back after."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install --no-deps "
                    "deepspeed==0.19.8 and the deepspeed extra's needs)")
import deepspeed_cases as cases  # noqa: E402 - after the skip

from ckptio.testing.rank_processes import run_ranks  # noqa: E402

LIMIT_S = 240


def _zero3_weights_only(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A ZeRO-3 job trains and saves through ckptio; fresh engines (another seed's weights)
    load its weights without optimizer states, then as load_module_only -> whether each
    rank's partitions equal the saved ones, and whether zero_to_fp32's torch is torch again."""
    import deepspeed.utils.zero_to_fp32 as z2f

    import ckptio.deepspeed_engine

    def fresh(seed: int) -> Any:
        engine = cases.engine_for(3, world_size)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        with torch.no_grad():  # weights unlike the saved ones
            for p in engine.module.parameters():
                p.ds_tensor.copy_(torch.randn(p.ds_tensor.shape,
                                              generator=torch.Generator().manual_seed(seed)))
        return engine

    def params(engine: Any) -> list[torch.Tensor]:
        return [p.ds_tensor.detach().clone() for p in engine.module.parameters()]

    engine = fresh(0)
    cases.train(engine, cases.SAVE_AT)
    engine.save_checkpoint(root)
    saved = params(engine)
    engine.destroy()
    out: dict[str, Any] = {}
    for name, kwargs in (("weights", {}), ("module_only", {"load_module_only": True})):
        engine = fresh(1 + rank)
        before = params(engine)
        engine.load_checkpoint(root, load_optimizer_states=False, **kwargs)
        got = params(engine)
        out[name] = (all(torch.equal(a, b) for a, b in zip(got, saved)),
                     any(not torch.equal(a, b) for a, b in zip(before, saved)))
        engine.destroy()
    out["torch_back"] = z2f.torch is torch
    return out


def test_zero3_weights_without_optimizer_states_load_bitwise_through_ckptio(
        tmp_path: Path) -> None:
    """DeepSpeed's ZeRO-3 weights-only loads (test_not_load_optimizer_state[3],
    test_load_module_only[3] in DeepSpeed's own tests) read ckptio's files: each rank's
    partitions are the saved ones, bit for bit (they differed before the load)."""
    got = run_ranks(2, _zero3_weights_only, str(tmp_path / "z3"), timeout_s=LIMIT_S)
    for rank, out in enumerate(got):
        assert out["weights"] == (True, True), (rank, out)
        assert out["module_only"] == (True, True), (rank, out)
        assert out["torch_back"] is True, (rank, out)
