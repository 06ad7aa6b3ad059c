"""Every random number generator a training job resumes, as one Stateful value.

    state = {"model": model, "optim": opt, "rng": ckptio.RNGState()}
    ckptio.save(state, path)        # captures Python, numpy, torch CPU and every CUDA device
    ckptio.load(path, state)        # restores them (through RNGState.load_state_dict)

Owns: capturing and restoring the generators' states in a compact form (each Mersenne Twister
state is one int64 tensor, not 625 inline values). With many ranks each rank's generators
differ, so ckptio keeps these tensors per rank (as it does any plain tensor whose bytes differ).
Does not own: how the values are stored (the save path) or generators a user made themselves
(``torch.Generator`` objects: put their ``get_state()`` in the state).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ckptio.errors import StateMismatchError

__all__ = ["RNGState"]


def _numpy() -> Any | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _python_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "mt": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next}


def _set_python(saved: dict[str, Any]) -> None:
    internal = tuple(int(v) for v in saved["mt"].tolist())
    random.setstate((int(saved["version"]), internal, saved["gauss_next"]))


def _numpy_state(numpy: Any) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
    return {"bit_generator": name, "mt": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _set_numpy(numpy: Any, saved: dict[str, Any]) -> None:
    keys = saved["mt"].numpy().astype("uint32")
    numpy.random.set_state((saved["bit_generator"], keys, int(saved["pos"]),
                            int(saved["has_gauss"]), float(saved["cached_gaussian"])))


class RNGState:
    """A Stateful holding no state of its own: ``state_dict()`` reads the process's generators
    (Python's ``random``, numpy's global generator when numpy is installed, torch's CPU
    generator, and every CUDA device's when CUDA is available); ``load_state_dict()`` sets
    them. Put one in the saved state; loading restores the generators in place."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": _python_state(), "torch": torch.get_rng_state()}
        numpy = _numpy()
        if numpy is not None:
            state["numpy"] = _numpy_state(numpy)
        if torch.cuda.is_available():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _set_python(state["python"])
        torch.set_rng_state(state["torch"])
        numpy = _numpy()
        if "numpy" in state and numpy is not None:
            _set_numpy(numpy, state["numpy"])
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            if len(cuda) != torch.cuda.device_count():
                raise StateMismatchError(
                    f"rng.cuda: the checkpoint holds {len(cuda)} CUDA generator states, this "
                    f"process sees {torch.cuda.device_count()} devices; restore on the same "
                    "number of devices per process, or leave RNG state out with keys=...")
            torch.cuda.set_rng_state_all(cuda)
