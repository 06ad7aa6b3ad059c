"""The bytes a StoreGroup key holds: a message stamped with its step, and many as one; many
keys got or set in one call.

Every message a rank leaves in the job's store for a step carries that step's number in
front, so a rank that reads a key left by another step (ranks calling the collectives in
different orders) fails naming both steps instead of reading the wrong message. An
all-gather's answer is the gathered messages packed into one byte string, with a checksum
that tells a damaged one.

Call order: storegroup.py's StoreGroup ``stamped`` on every message it sets and
``unstamped`` on every one it gets; ``pack`` on the coordinator's all-gather answer and
``unpack`` on every rank; ``get_many`` / ``set_many`` where it reads or writes one key per rank.

Owns: those layouts and their checks. Does not own: which keys, when, and the waits
(storegroup.py), what the messages say (wire.py, step.py).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from ckptio.errors import RankFailedError

__all__ = ["get_many", "pack", "set_many", "stamped", "unpack", "unstamped"]

_STAMP = struct.Struct("<Q")


def stamped(step: int, data: bytes) -> bytes:
    """``data`` with ``step``'s number in front."""
    return _STAMP.pack(step) + data


def unstamped(step: int, value: bytes, *, what: str) -> bytes:
    """``value`` without its stamp, which must be ``step``'s (``what``: the key, for the error)."""
    value = bytes(value)
    got = _STAMP.unpack_from(value)[0]
    if got != step:  # internal: the ranks' steps are out of order
        raise RankFailedError(f"{what}: expected the message of step {step}, found step {got}; "
                              "the ranks called ckptio's collective saves or loads in different "
                              "orders")
    return value[_STAMP.size:]


def pack(parts: list[bytes]) -> bytes:
    """Byte strings as one: their count, each length, then the bytes; with a CRC32."""
    body = struct.pack(f"<I{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)
    return struct.pack("<I", zlib.crc32(body)) + body


def unpack(data: bytes) -> list[bytes]:
    crc, count = struct.unpack_from("<II", data)
    if zlib.crc32(data[4:]) != crc:
        raise RankFailedError("all_gather: the coordinator's message arrived damaged")
    lengths = struct.unpack_from(f"<{count}Q", data, 8)
    out, at = [], 8 + 8 * count
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out


def get_many(store: Any, keys: list[str]) -> list[bytes]:
    """One round trip where the store has multi_get (torch >= 2.5), else one per key."""
    if hasattr(store, "multi_get"):
        return list(store.multi_get(keys))
    return [store.get(key) for key in keys]


def set_many(store: Any, keys: list[str], values: list[bytes]) -> None:
    """One round trip where the store has multi_set, else one per key."""
    if hasattr(store, "multi_set"):
        store.multi_set(keys, values)
        return
    for key, value in zip(keys, values):
        store.set(key, value)
