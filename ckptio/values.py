"""Python leaves <-> tagged JSON, without pickle.

Owns: which plain Python values ckptio stores inline in the manifest and their exact encoding
(floats as hex so every bit survives). Does not own: tensors, numpy arrays or bytes (those are
stored as data entries), nor pickled objects (flatten decides when pickle is allowed).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from .types import Json


class NotEncodable(Exception):
    """Internal signal: this value has no pickle-free encoding."""


_INT_LIMIT = 1 << 63


def _float(value: float) -> str:
    if math.isnan(value):  # keep the sign and payload bits of a NaN
        return "nan:" + struct.pack(">d", value).hex()
    if math.isfinite(value):
        return value.hex()
    return repr(value)  # 'inf', '-inf'


def _int(value: int) -> int | str:
    """Beyond 64 bits, hex text: JSON readers lose such ints, and Python's decimal conversion
    refuses more than 4300 digits; hex has no such limit."""
    return value if -_INT_LIMIT <= value < _INT_LIMIT else hex(value)


def encode(value: Any) -> Json:
    """Tag a scalar leaf as [type, payload]; raise NotEncodable for anything else."""
    if value is None:
        return ["none", None]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", _int(int(value))]
    if isinstance(value, float):
        return ["float", _float(value)]
    if isinstance(value, complex):
        return ["complex", [_float(value.real), _float(value.imag)]]
    if isinstance(value, str):
        return ["str", value]
    if isinstance(value, torch.Size):
        return ["size", list(value)]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).removeprefix("torch.")]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    raise NotEncodable(type(value).__name__)


def decode(tagged: Json) -> Any:
    """Inverse of encode. Raises ValueError on a malformed tag (the manifest validator names it)."""
    if not (isinstance(tagged, list) and len(tagged) == 2 and isinstance(tagged[0], str)):
        raise ValueError(f"expected [type, value], got {tagged!r:.80}")
    tag, payload = tagged
    if tag == "none":
        return None
    if tag == "bool" and isinstance(payload, bool):
        return payload
    if tag == "int" and isinstance(payload, int) and not isinstance(payload, bool):
        return payload
    if tag == "int" and isinstance(payload, str):
        return int(payload, 16)
    if tag == "float" and isinstance(payload, str):
        return _parse_float(payload)
    if tag == "complex" and isinstance(payload, list) and len(payload) == 2:
        return complex(_parse_float(payload[0]), _parse_float(payload[1]))
    if tag == "str" and isinstance(payload, str):
        return payload
    if tag == "size" and isinstance(payload, list) and all(type(d) is int for d in payload):
        return torch.Size(payload)
    if tag == "dtype" and isinstance(payload, str):
        dtype = getattr(torch, payload, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    if tag == "device" and isinstance(payload, str):
        return torch.device(payload)
    raise ValueError(f"unknown or malformed value tag {tag!r} with payload {payload!r:.80}")


def _parse_float(text: Any) -> float:
    if not isinstance(text, str):
        raise ValueError(f"float payload must be a string, got {text!r:.80}")
    if text.startswith("nan:"):
        return struct.unpack(">d", bytes.fromhex(text[4:]))[0]
    if text in ("nan", "inf", "-inf"):
        return float(text)
    return float.fromhex(text)
