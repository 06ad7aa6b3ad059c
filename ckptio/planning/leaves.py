"""What kind each leaf of a state is, and the bytes that hold it.

A tensor is stored as itself (dense and with data: no meta tensors); bytes, a bytearray and
a BytesIO's content as their bytes; a numpy array or scalar as the tensor over its memory; a
plain Python value inline as tagged JSON (format/values.py); anything else pickled, only with
``allow_pickle``, and refused otherwise with what to do instead. Each kind comes back on load
as the type it was.

Call order: plan.py's build_plan calls ``classify`` on every leaf not held as a shard
(``check_tensor`` on a shard's local tensor) and ``dtype_name`` on every tensor it writes;
dcp/writeplan.py calls ``dtype_name`` for DCP's items.

Owns: the kinds, the host-side tensor over each leaf's bytes, and refusing what ckptio does
not store (a dtype, a numpy dtype, an object without pickle). Does not own: the items and
aliases made of them (plan.py), sharded leaves (sharding.py), the inline encoding
(format/values.py). No I/O.
"""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any

import torch

from ckptio.errors import UnsupportedStateError
from ckptio.format import values
from ckptio.format.types import DTYPE_ITEMSIZE
from ckptio.planning.sharding import check_dense

__all__ = ["check_tensor", "classify", "dtype_name"]


def dtype_name(dtype: torch.dtype, key: str, fix: str = "convert it to a standard dtype first"
               ) -> str:
    """``dtype``'s ckptio name (``float32``); UnsupportedStateError naming ``key`` and ``fix``
    for one ckptio does not store."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise UnsupportedStateError(
            f"key {key!r}: dtype {name} is not one ckptio stores ({', '.join(DTYPE_ITEMSIZE)}); "
            f"{fix}")
    return name


def check_tensor(t: torch.Tensor, key: str) -> None:
    check_dense(t, key)
    if t.device.type == "meta":
        raise UnsupportedStateError(
            f"key {key!r}: a meta tensor holds no data to save (a module built under "
            'torch.device("meta") and never materialized): give it its values first '
            '(module.to_empty(device=...) then init or load them), or leave it out of the state')


def _numpy_source(value: Any, key: str) -> tuple[str, torch.Tensor] | None:
    module = type(value).__module__
    if not module.startswith("numpy"):
        return None
    import numpy as np

    if isinstance(value, np.generic):
        return "numpy_scalar", _from_numpy(np.asarray(value), key)
    if isinstance(value, np.ndarray):
        return "numpy", _from_numpy(value, key)
    return None


def _from_numpy(array: Any, key: str) -> torch.Tensor:
    import numpy as np

    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # (never on 0-d arrays: it would make them 1-d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only arrays: we only ever read from them
            return torch.from_numpy(array)
    except TypeError:
        raise UnsupportedStateError(
            f"key {key!r}: numpy dtype {array.dtype} has no torch equivalent; convert it, or "
            "pass allow_pickle=True to store it pickled"
        ) from None


def _bytes_source(data: bytes | bytearray | memoryview) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def classify(value: Any, key: str, allow_pickle: bool) -> tuple[str, Any]:
    """-> (kind, payload): payload is a tensor for data kinds, tagged JSON for 'object'."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, key)
        return "tensor", value
    if isinstance(value, (bytes, bytearray)):  # each comes back as the type it was
        return ("bytearray" if isinstance(value, bytearray) else "bytes"), _bytes_source(value)
    if isinstance(value, io.BytesIO):  # DCP's TrainState pattern: its content, no pickle
        return "bytesio", _bytes_source(value.getbuffer())
    numpy_source = _numpy_source(value, key)
    if numpy_source is not None:
        return numpy_source
    try:
        return "object", values.encode(value)
    except values.NotEncodable:
        pass
    if not allow_pickle and isinstance(value, torch.utils.data.DataLoader):  # nor pickled
        raise UnsupportedStateError(
            f"key {key!r}: a torch DataLoader has no state_dict(), so where it is in its epoch "
            "cannot be saved; use a loader that has one (torchdata's StatefulDataLoader), or "
            "put what rebuilds its position (epoch, batches seen) in the state instead")
    if not allow_pickle and isinstance(value, torch.Generator):  # pickled, a load swaps it
        raise UnsupportedStateError(  # for another object: the loader's would not be restored
            f"key {key!r}: a torch.Generator is saved as its state: put {key.rsplit('.', 1)[-1]!r}"
            ": gen.get_state() (a tensor) in the state, and after the load call "
            "gen.set_state(...) on the generator your DataLoader or sampler holds")
    if not allow_pickle:
        raise UnsupportedStateError(
            f"key {key!r}: a {type(value).__module__}.{type(value).__qualname__} cannot be "
            "stored without pickle; convert it to tensors/str/int/float/bytes, or pass "
            "allow_pickle=True (loading it will then need allow_pickle=True too)"
        )
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # what pickle raises
        raise UnsupportedStateError(
            f"key {key!r}: allow_pickle=True, but this {type(value).__module__}."
            f"{type(value).__qualname__} cannot be pickled ({type(exc).__name__}: {exc}); "
            "leave it out of the state (keys=... on load), or store what rebuilds it (e.g. "
            "a module-level function's name instead of a lambda)") from exc
    return "pickle", _bytes_source(data)
