"""The random generators in Lightning's checkpoints: ``ckptio.lightning.RNGStateCallback``.

    trainer = lightning.Trainer(plugins=[ckptio.lightning.CheckpointIO()],
                                callbacks=[ModelCheckpoint(save_last=True),
                                           ckptio.lightning.RNGStateCallback()])

Lightning's checkpoint holds no generator state, so a run that draws random numbers (dropout,
``shuffle=True``, augmentation) does not resume bitwise. This callback adds it: its
``state_dict()``, which Lightning calls on every rank when it builds a checkpoint, gathers every
rank's generators (ckptio.RNGState: Python's, numpy's, torch's CPU and CUDA generators) over the
job's process group, and ``load_state_dict()`` gives each rank its own again, in a fit only
(a ``validate(ckpt_path=...)`` leaves the generators as they are). A resume on another number
of ranks cannot continue the saved draws: it warns and leaves the generators as seeded.

Call order (Lightning's): ``setup`` (the stage), ``state_dict`` at each checkpoint,
``load_state_dict`` once when a fit resumes. Owns: what goes into the callback's entry of the
checkpoint and restoring it. Does not own: the generators' state (ckptio/rng.py), saving and
loading (the CheckpointIO plugins, ckptio/lightning.py). Works with ``import lightning`` and the
standalone ``pytorch_lightning`` (the class subclasses each installed package's Callback).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import Any

import torch

from ckptio.rng import RNGState

__all__ = ["RNGStateCallback"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _callback_bases() -> tuple[type, ...]:
    """The Callback class of each installed Lightning package (its Trainer checks isinstance)."""
    found = tuple(importlib.import_module(name).Callback for name in _PACKAGES
                  if importlib.util.find_spec(name.split(".")[0]) is not None)
    if not found:
        raise ImportError("ckptio.lightning needs Lightning: pip install lightning (or "
                          "pytorch_lightning)")
    return found


class RNGStateCallback(*_callback_bases()):  # type: ignore[misc]
    """Every rank's random generators saved in Lightning's checkpoints and restored when a fit
    resumes (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._fitting = False

    @property
    def state_key(self) -> str:
        return "ckptio.RNGState"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._fitting = stage == "fit"

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generators, in rank order (collective where a process group runs:
        Lightning builds a checkpoint on every rank)."""
        mine = RNGState().state_dict()
        world = _world()
        if world == 1:
            return {"ranks": [mine]}
        every: list[Any] = [None] * world
        torch.distributed.all_gather_object(every, mine)
        return {"ranks": every}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's generators as saved, in a fit; warns instead on another number of
        ranks."""
        if not self._fitting:
            return
        ranks = state_dict.get("ranks") or []
        world = _world()
        if len(ranks) != world:
            warnings.warn(
                f"ckptio: the checkpoint holds the random generators of {len(ranks)} rank(s), "
                f"this run has {world}: they are left as this run seeded them, so the resumed "
                "run does not draw what the saved one would have (not bitwise)", stacklevel=2)
            return
        rank = torch.distributed.get_rank() if world > 1 else 0
        RNGState().load_state_dict(ranks[rank])


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
