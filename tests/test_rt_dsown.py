"""ckptio.deepspeed_engine against DeepSpeed's own checkpoint tests (tests/unit/checkpoint,
run by dev/deepspeed_own_tests.sh): what passed there with DeepSpeed's engine and failed with
ckptio's, on a real DeepSpeed engine (CPU accelerator, two gloo ranks).

ZeRO-3's ``load_checkpoint(load_optimizer_states=False)`` (and with ``load_module_only``):
DeepSpeed 0.19.8 rebuilds the weights with its zero_to_fp32, which calls ``torch.load`` on
every rank's files itself; ckptio refused it (DeepSpeed's test_not_load_optimizer_state[3],
test_load_module_only[3], test_immediate_save_load[3], ...). Now those files are read through
ckptio and the weights load bitwise, with zero_to_fp32's torch put back after; a tag named
in the call gives its own weights (DeepSpeed read the tag ``latest`` names for them)."""

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
    """A ZeRO-3 job trains and saves through ckptio twice (``latest`` names the second tag);
    fresh engines (another seed's weights) load weights without optimizer states: the latest
    tag, as load_module_only, and the first tag by name -> for each, whether this rank's
    partitions equal that save's and differed before the load; whether zero_to_fp32's torch
    and the engine module's function are DeepSpeed's again."""
    import deepspeed.runtime.engine as ds_engine
    import deepspeed.utils.zero_to_fp32 as z2f

    import ckptio.deepspeed_engine

    fp32 = ds_engine.get_fp32_state_dict_from_zero_checkpoint

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
    first = params(engine)
    cases.train(engine, cases.MORE)
    engine.save_checkpoint(root)
    latest = params(engine)
    engine.destroy()
    out: dict[str, Any] = {}
    for name, kwargs, saved in (("weights", {}, latest),
                                ("module_only", {"load_module_only": True}, latest),
                                ("first_tag", {"tag": f"global_step{cases.SAVE_AT}"}, first)):
        engine = fresh(1 + rank)
        before = params(engine)
        engine.load_checkpoint(root, load_optimizer_states=False, **kwargs)
        got = params(engine)
        out[name] = (all(torch.equal(a, b) for a, b in zip(got, saved)),
                     any(not torch.equal(a, b) for a, b in zip(before, saved)))
        engine.destroy()
    out["put_back"] = z2f.torch is torch and ds_engine.get_fp32_state_dict_from_zero_checkpoint is fp32
    return out


def test_zero3_weights_without_optimizer_states_load_bitwise_through_ckptio(
        tmp_path: Path) -> None:
    """DeepSpeed's ZeRO-3 weights-only loads (test_not_load_optimizer_state[3],
    test_load_module_only[3] in DeepSpeed's own tests) read ckptio's files: each rank's
    partitions are the saved ones, bit for bit (they differed before the load); a tag asked
    for by name gives that tag's weights, not those of the tag ``latest`` names (DeepSpeed's
    zero_to_fp32 was called without the tag)."""
    got = run_ranks(2, _zero3_weights_only, str(tmp_path / "z3"), timeout_s=LIMIT_S)
    for rank, out in enumerate(got):
        assert out["weights"] == (True, True), (rank, out)
        assert out["module_only"] == (True, True), (rank, out)
        assert out["first_tag"] == (True, True), (rank, out)
        assert out["put_back"] is True, (rank, out)


def _zero3_saved_weights(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    """A ZeRO-3 job trains and saves through ckptio -> the whole weights it saved."""
    import deepspeed

    import ckptio.deepspeed_engine

    engine = cases.engine_for(3, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    cases.train(engine, cases.SAVE_AT)
    engine.save_checkpoint(root)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return saved


def test_zero3_weights_without_optimizer_states_load_on_fewer_ranks(tmp_path: Path) -> None:
    """ZeRO-3 saved on 2 ranks, its weights loaded without optimizer states on 1 (DeepSpeed's
    zero_to_fp32 rebuilds them from every rank's files, as with its own engine): bit for bit.
    use()'s guard refused it with an UnsupportedStateError ('saved by 2 data-parallel ranks')."""
    root = str(tmp_path / "z3")
    saved = run_ranks(2, _zero3_saved_weights, root, timeout_s=LIMIT_S)[0]
    got = run_ranks(1, cases.weights_on_fewer, root, 3, timeout_s=LIMIT_S)[0]
    assert isinstance(got, dict), got
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], saved[k]) for k in saved), "the weights differ"


def _zero3_module_only(rank: int, world_size: int, root: str) -> str:
    """A ZeRO-3 save, then a fresh engine's load_checkpoint(load_module_only=True) with the
    optimizer states (the default) -> the error's type and text, or what the load did."""
    import ckptio.deepspeed_engine

    _zero3_saved_weights(rank, world_size, root)
    engine = cases.engine_for(3, world_size)
    ckptio.deepspeed_engine.use(engine, allow_pickle=True)
    before = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(root, load_module_only=True)
    except Exception as exc:  # noqa: BLE001 - the test reads which exception it was
        return f"{type(exc).__name__}: {exc}"
    after = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
    return f"loaded; weights changed: {any(not torch.equal(a, b) for a, b in zip(before, after))}"


def test_zero3_module_only_with_optimizer_states_is_refused_naming_the_fix(
        tmp_path: Path) -> None:
    """ZeRO-3's load_checkpoint(load_module_only=True) (optimizer states left at the default)
    loaded no weights in DeepSpeed 0.19.8, with either engine (its model files hold empty
    placeholders): the model trained on from its own weights, silently. Refused on every rank
    naming load_optimizer_states=False."""
    got = run_ranks(2, _zero3_module_only, str(tmp_path / "z3"), timeout_s=LIMIT_S)
    for rank, said in enumerate(got):
        assert said.startswith("UnsupportedStateError"), (rank, said)
        assert "load_optimizer_states=False" in said and "global_step3" in said, (rank, said)


def _own_engine_then_ckptio(rank: int, world_size: int, root: str) -> Any:
    """A ZeRO-2 job saves with DeepSpeed's own engine and trains on; a fresh job loads that
    tag through ckptio's engine -> whether it trained on alike, or the error's type and text."""
    import ckptio.deepspeed_engine

    engine = cases.engine_for(2, world_size)  # DeepSpeed's own TorchCheckpointEngine
    cases.train(engine, cases.SAVE_AT)
    engine.save_checkpoint(root)
    losses = cases.train(engine, cases.MORE)
    engine.destroy()
    resumed = cases.engine_for(2, world_size)
    ckptio.deepspeed_engine.use(resumed, allow_pickle=True)
    try:
        resumed.load_checkpoint(root)
    except Exception as exc:  # noqa: BLE001 - the test reads which exception it was
        return f"{type(exc).__name__}: {exc}"
    return cases.train(resumed, cases.MORE) == losses


def test_a_zero2_tag_of_deepspeeds_own_engine_resumes_through_ckptio(tmp_path: Path) -> None:
    """A job switching to ckptio's engine between tags (docs/guides/deepspeed.md): ZeRO 1/2's
    model file of DeepSpeed's own engine holds each parameter as a view of one flat buffer,
    which ckptio's torch.save reader refused ("different views of one storage ... load the
    file with torch.load"); it is now read with torch.load, as that engine reads it, and the
    job trains on bitwise."""
    got = run_ranks(2, _own_engine_then_ckptio, str(tmp_path / "own"), timeout_s=LIMIT_S)
    assert got == [True, True], got


def _another_stage(rank: int, world_size: int, root: str) -> list[str]:
    """ZeRO-2 and ZeRO-3 jobs save through ckptio; fresh engines load each at the other stage
    -> the error's type and text for each."""
    import ckptio.deepspeed_engine

    said = []
    for saved, loaded in ((2, 3), (3, 2)):
        engine = cases.engine_for(saved, world_size)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        cases.train(engine, 1)
        engine.save_checkpoint(f"{root}{saved}")
        engine.destroy()
        engine = cases.engine_for(loaded, world_size)
        ckptio.deepspeed_engine.use(engine, allow_pickle=True)
        try:
            engine.load_checkpoint(f"{root}{saved}")
            said.append("loaded")
        except Exception as exc:  # noqa: BLE001 - the test reads which exception it was
            said.append(f"{type(exc).__name__}: {exc}")
        engine.destroy()
    return said


def test_a_tag_loaded_at_another_zero_side_names_both_stages(tmp_path: Path) -> None:
    """ZeRO 0-2 write one whole model file, ZeRO-3 one per data-parallel rank: an engine of
    the other kind found none of its own, and DeepSpeed failed with an empty AssertionError
    (with its own engine too). Refused on every rank naming the stages and the ways on."""
    got = run_ranks(2, _another_stage, str(tmp_path / "z"), timeout_s=LIMIT_S)
    for rank in (0, 1):
        to3, to2 = got[rank]
        assert to3.startswith("UnsupportedStateError") and "ZeRO stage 3" in to3, (rank, to3)
        assert "stage 0, 1 or 2" in to3, (rank, to3)
        assert to2.startswith("UnsupportedStateError") and "under ZeRO-3" in to2, (rank, to2)
        assert "ZeRO stage 2" in to2 and "zero_to_fp32" in to2, (rank, to2)
