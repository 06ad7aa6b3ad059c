"""Shim (ckptio, not DeepSpeed's): DeepSpeed 0.19's own checkpoint unit tests
(tests/unit/checkpoint) on the CPU accelerator with gloo, every engine they build saving and
loading through ckptio's checkpoint engine (SWAP=ckptio, the default) or DeepSpeed's own
(SWAP=torch). A pytest plugin (``-p deepspeed_own_conftest``, dev/ on PYTHONPATH), run from a
DeepSpeed checkout's tests/ folder: dev/deepspeed_own_tests.sh.

What it changes in DeepSpeed's harness (tests/unit/common.py): its ranks are forked (it uses
forkserver, whose ranks import the test modules afresh and would not see this shim), its
backend is gloo, its DistributedFixtures are registered as fixtures (pytest 9 no longer finds
them), a test of more ranks than NUMA nodes is not skipped, and DeepSpeed's CPU backend skips
the JIT compile of its shared-memory allreduce (for inference; minutes of g++ on a busy
machine). Tests of tag v0.19.5 against DeepSpeed 0.19.8: an engine without
``sparse_tensor_module_names`` (0.19.8 has none) is compared without it. With SWAP=ckptio,
``deepspeed.initialize`` returns engines on which ``ckptio.deepspeed_engine.use(engine,
allow_pickle=True)`` was called (the way docs/guides/deepspeed.md selects it)."""
import importlib
import os
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# the CPU accelerator counts NUMA nodes as devices (one here), and the harness skips a test of
# more ranks than devices; each rank sets its own LOCAL_SIZE (the world size)
os.environ.setdefault("LOCAL_SIZE", "8")

import deepspeed  # noqa: E402
import pytest  # noqa: E402
import torch.multiprocessing  # noqa: E402

SWAP = os.environ.get("SWAP", "ckptio")
if SWAP not in ("ckptio", "torch"):
    raise SystemExit(f"SWAP={SWAP!r}: ckptio or torch")

importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

_initialize = deepspeed.initialize


def _initialize_through_ckptio(*args: Any, **kwargs: Any) -> Any:
    out = _initialize(*args, **kwargs)
    import ckptio.deepspeed_engine

    ckptio.deepspeed_engine.use(out[0], allow_pickle=True)
    return out


if SWAP == "ckptio":
    deepspeed.initialize = _initialize_through_ckptio


_set_start_method = torch.multiprocessing.set_start_method


def _fork_instead(method: str, force: bool = False) -> None:
    """The harness's (and a test's own) forkserver start replaced by fork: a forkserver rank
    imports the test module afresh, without this plugin (and so with DeepSpeed's engine)."""
    _set_start_method("fork" if method == "forkserver" else method, force=force)


torch.multiprocessing.set_start_method = _fork_instead


def _distributed_fixture(name: str) -> Any:
    """The DistributedFixture class ``name`` of the requesting test's module as a fixture: the
    harness registers them through an attribute pytest 9 no longer reads ('fixture not
    found'); here each runs as the harness runs it (its ranks, then the test's)."""

    @pytest.fixture(name=name)
    def run(request: Any) -> None:
        getattr(request.module, name)()(request)

    return run


ws4_model_checkpoint = _distributed_fixture("ws4_model_checkpoint")
ws4_model_checkpoint_zeropp = _distributed_fixture("ws4_model_checkpoint_zeropp")
baseline_ws2 = _distributed_fixture("baseline_ws2")
baseline_ws4 = _distributed_fixture("baseline_ws4")


def pytest_configure(config: Any) -> None:
    from unit import common

    common.DistributedExec.backend = "gloo"
    from unit.checkpoint import common as checkpoint_common

    compare = checkpoint_common.compare_deepspeed_states

    def compare_deepspeed_states(saved_model: Any, loaded_model: Any) -> None:
        """tests/unit of tag v0.19.5 against DeepSpeed 0.19.8, whose engine has no
        ``sparse_tensor_module_names``: compared where both engines have it."""
        if not hasattr(saved_model, "sparse_tensor_module_names"):
            saved_model.sparse_tensor_module_names = loaded_model.sparse_tensor_module_names = ()
        compare(saved_model, loaded_model)

    checkpoint_common.compare_deepspeed_states = compare_deepspeed_states
    print(f"+ deepspeed {deepspeed.__version__}, checkpoint engine: "
          f"{'ckptio (use(engine, allow_pickle=True))' if SWAP == 'ckptio' else 'DeepSpeed'}")


def pytest_report_header(config: Any) -> str:
    return f"deepspeed_own_conftest: SWAP={SWAP}"
