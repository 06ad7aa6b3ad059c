"""Python leaves <-> tagged JSON, without pickle.

Owns: which plain Python values ckptio stores inline in the manifest, their exact encoding
(floats as hex so every bit survives) and the strict decoding of that JSON, which treats it as
hostile (any malformed tag or payload is a ValueError naming it). Does not own: tensors and
numpy arrays (stored as data entries; so are the bytes and BytesIO leaves a save sees, which
come here only from inside a DCP value: base64 inline), nor pickled objects (plan.py decides
when pickle is allowed). Imports torch only to decode a size, dtype or device (the ``ckptio``
command reads manifests without torch).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptio.format.types import Json, show

if TYPE_CHECKING:
    import torch

__all__ = ["NotEncodable", "decode", "encode"]


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
    if isinstance(value, bytearray):
        return ["bytearray", base64.b64encode(value).decode("ascii")]
    if isinstance(value, bytes):
        return ["bytes", base64.b64encode(value).decode("ascii")]
    if isinstance(value, io.BytesIO):
        return ["bytesio", base64.b64encode(value.getbuffer()).decode("ascii")]
    torch = sys.modules.get("torch")  # not imported: the value is no torch object
    if torch is None:
        raise NotEncodable(type(value).__name__)
    if isinstance(value, torch.Size):
        return ["size", list(value)]
    if isinstance(value, torch.dtype):
        return ["dtype", str(value).removeprefix("torch.")]
    if isinstance(value, torch.device):
        return ["device", str(value)]
    raise NotEncodable(type(value).__name__)


def decode(tagged: Json) -> Any:
    """Inverse of encode. Raises ValueError, naming what is wrong, on any malformed tag or
    payload (the manifest validator turns it into a ManifestError naming the key); never
    another exception, whatever the JSON holds."""
    if not (isinstance(tagged, list) and len(tagged) == 2 and isinstance(tagged[0], str)):
        raise ValueError(f"expected [type, value], got {show(tagged)}")
    tag, payload = tagged
    parse = _DECODERS.get(tag)
    if parse is None:
        raise ValueError(f"unknown value type {show(tag)}")
    return parse(payload)


def _fail(tag: str, payload: Any, why: str) -> ValueError:
    return ValueError(f"{tag} value {show(payload)}: {why}")


def _none(payload: Any) -> None:
    if payload is not None:
        raise _fail("none", payload, "the payload must be null")


def _bool(payload: Any) -> bool:
    if not isinstance(payload, bool):
        raise _fail("bool", payload, "the payload must be true or false")
    return payload


_HEX_INT = re.compile(r"-?0x[0-9a-f]+")


def _int_value(payload: Any) -> int:
    if type(payload) is int:
        return payload
    if isinstance(payload, str) and _HEX_INT.fullmatch(payload):
        return int(payload, 16)
    raise _fail("int", payload, "the payload must be an integer or hex text such as '-0x1f'")


def _complex(payload: Any) -> complex:
    if not (isinstance(payload, list) and len(payload) == 2):
        raise _fail("complex", payload, "the payload must be [real, imag]")
    return complex(_parse_float(payload[0]), _parse_float(payload[1]))


def _str(payload: Any) -> str:
    if not isinstance(payload, str):
        raise _fail("str", payload, "the payload must be a string")
    return payload


def _bytes(payload: Any) -> bytes:
    if not isinstance(payload, str):
        raise _fail("bytes", payload, "the payload must be base64 text")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _fail("bytes", payload, "not base64 text") from None


def _bytearray(payload: Any) -> bytearray:
    return bytearray(_bytes(payload))


def _bytesio(payload: Any) -> io.BytesIO:
    return io.BytesIO(_bytes(payload))


def _size(payload: Any) -> torch.Size:
    import torch

    if not (isinstance(payload, list)
            and all(type(d) is int and 0 <= d < _INT_LIMIT for d in payload)):
        raise _fail("size", payload, "the payload must be a list of integers in [0, 2^63)")
    return torch.Size(payload)


def _dtype(payload: Any) -> torch.dtype:
    import torch

    # vars(torch), not getattr: a name must not reach torch's lazy submodule imports
    dtype = vars(torch).get(payload) if isinstance(payload, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _fail("dtype", payload, f"not a dtype of this torch {torch.__version__}")
    return dtype


def _device(payload: Any) -> torch.device:
    import torch

    if not isinstance(payload, str):
        raise _fail("device", payload, "the payload must be a device string")
    try:
        return torch.device(payload)
    except RuntimeError as exc:  # torch's parser: 'Invalid device string', bad index, type
        raise _fail("device", payload, str(exc).split("\n", 1)[0]) from None


_NAN_BITS = re.compile(r"nan:[0-9a-f]{16}")
_HEX_FLOAT = re.compile(r"-?0x[0-9a-f]+(\.[0-9a-f]*)?(p[-+]?[0-9]+)?", re.IGNORECASE)


def _parse_float(text: Any) -> float:
    """float.hex() text, 'nan', 'inf', '-inf', or 'nan:' and the 16 hex digits of a NaN's bits."""
    if not isinstance(text, str):
        raise _fail("float", text, "the payload must be a string")
    if text.startswith("nan:"):
        if not _NAN_BITS.fullmatch(text):
            raise _fail("float", text, "'nan:' must be followed by 16 hex digits")
        value: float = struct.unpack(">d", bytes.fromhex(text[4:]))[0]
        if not math.isnan(value):
            raise _fail("float", text, "the bits after 'nan:' are not a NaN")
        return value
    if text in ("nan", "inf", "-inf"):
        return float(text)
    if not _HEX_FLOAT.fullmatch(text):
        raise _fail("float", text, "not float.hex() text")
    try:
        return float.fromhex(text)
    except OverflowError:
        raise _fail("float", text, "too large for a float") from None
    except ValueError:
        raise _fail("float", text, "not float.hex() text") from None


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "none": _none, "bool": _bool, "int": _int_value, "float": _parse_float, "complex": _complex,
    "str": _str, "bytes": _bytes, "bytearray": _bytearray, "bytesio": _bytesio, "size": _size,
    "dtype": _dtype, "device": _device,
}
