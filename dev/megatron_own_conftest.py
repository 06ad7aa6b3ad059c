"""Shim (ckptio, not Megatron's): Megatron-Core 0.19's own dist_checkpointing unit tests in one
CPU process on gloo, with dist_checkpointing.save/load's default strategies replaced by
ckptio's (ckptio/megatron_strategy.py). Megatron's Utils wants NCCL and a GPU: replaced here."""
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed

torch.cuda.set_device = lambda *a, **k: None
torch.cuda.device_count = lambda: 1
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
torch.cuda.memory.empty_cache = lambda: None

from megatron.core.dist_checkpointing import serialization  # noqa: E402
from ckptio.megatron_strategy import CkptioLoadShardedStrategy, CkptioSaveShardedStrategy  # noqa: E402
from tests.unit_tests.dist_checkpointing import TempNamedDir  # noqa: E402
from tests.unit_tests.test_utilities import Utils  # noqa: E402

if os.environ.get("SWAP", "ckptio") == "ckptio":
    serialization.TorchDistSaveShardedStrategy = CkptioSaveShardedStrategy
    serialization.TorchDistLoadShardedStrategy = CkptioLoadShardedStrategy
    serialization.get_default_load_sharded_strategy = lambda checkpoint_dir=None: CkptioLoadShardedStrategy()
    serialization.get_default_save_sharded_strategy = lambda backend="torch_dist": CkptioSaveShardedStrategy()


def _init():
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
    Utils.inited = True


Utils.initialize_distributed = staticmethod(_init)


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory) -> Path:
    tmp_dir = tmp_path_factory.mktemp("ignored", numbered=False).parent.parent / "tmp_dist_ckpt"
    _init()
    with TempNamedDir(tmp_dir, sync=False):
        yield tmp_dir
