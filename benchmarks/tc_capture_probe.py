"""When does an async save capture a tensor the loop changes in place after the call returns?

torch_checkpointing's async ``save`` (its CPU configuration, buffered writes) and ckptio's lazy
``async_save(lazy=True, optimizers=[opt])`` each save ``{"buf": t, ...}``; right after the call
returns the loop adds 1 to ``t`` in place (what forward does to a BatchNorm's running stats,
which no optimizer owns and ``lock()`` does not guard); the saved value is read back. A save
that captured at its call holds the value of the call; one that captured later holds the
value after. Three saves each, into a temporary directory:

    python -m benchmarks.tc_capture_probe [--mib 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tc_saves(root: Path, t: torch.Tensor, saves: int) -> list[tuple[float, float]]:
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = config.build()
    out = []
    for i in range(saves):
        at_call = float(t[0])
        future = manager.save(str(root / f"tc{i}"), {"model": {"buf": t, "n": i}})
        t.add_(1)
        future.result()
        saved = torch.load(root / f"tc{i}" / "model_0.pt", weights_only=True)["buf"]
        out.append((at_call, float(saved.max())))
    manager.close()
    return out


def ckptio_saves(root: Path, t: torch.Tensor, saves: int) -> list[tuple[float, float]]:
    import torch

    import ckptio

    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    ck = ckptio.Checkpointer()
    out = []
    for i in range(saves):
        at_call = float(t[0])
        handle = ck.async_save({"model": {"buf": t, "p": p}, "optim": opt}, str(root / f"ck{i}"),
                               lazy=True, optimizers=[opt])
        t.add_(1)
        handle.wait()
        out.append((at_call, float(ckptio.load(str(root / f"ck{i}"))["model"]["buf"].max())))
    ck.close()
    return out


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="the tensor's size")
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("torch_checkpointing async save", tc_saves),
                          ("ckptio lazy async_save", ckptio_saves)):
            got = run(Path(tmp), torch.zeros(args.mib << 18), args.saves)
            late = sum(saved != at_call for at_call, saved in got)
            print(f"{name}: (value at the call, value saved) = {got}; "
                  f"{late} of {len(got)} saves hold a later value")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
