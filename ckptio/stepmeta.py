"""A checkpoint's own metadata, beside its tensors: the metrics and the caller's metadata a save
stores in its manifest, and reading them back without loading anything else.

    ckptio.Checkpointer().save(state, path, metrics={"val_loss": 0.31},
                               metadata={"config": {"lr": 3e-4}})
    ckptio.read_metadata(path)   # {"metrics": {"val_loss": 0.31}, "metadata": {...}, ...}

Both live in the manifest's ``meta`` object (docs/FORMAT.md): committed atomically with the
step (a crash leaves the previous manifest, metadata included) and covered by its CRC-32.
Reading them reads the manifest only (no data file, no index file, no torch).

- ``metrics``: str -> a number (int or float; bool refused). NaN and infinities are allowed
  (a diverged loss is still a loss) and stored as the strings ``"nan"``, ``"inf"``, ``"-inf"``
  (strict JSON has no such numbers); read back as floats.
- ``metadata``: str -> any JSON value (None, bool, int, float, str, lists/tuples, dicts with
  str keys), nested at most MAX_DEPTH levels, at most MAX_NBYTES encoded. A float in it must be
  finite. Tuples come back as lists.

Owns: the checks and the encoding of both, and reading them from a checkpoint. Does not own:
the manifest's format (format/manifest.py) or where a save writes it (saving/, distributed/).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ckptio.errors import CkptError, ManifestError
from ckptio.format import manifest
from ckptio.options import Options
from ckptio.storage.select import checkpoint_path, store_for

__all__ = ["MAX_DEPTH", "MAX_INT_BITS", "MAX_NBYTES", "encode", "read_metadata"]

MAX_DEPTH = 64  # nesting of metadata (the manifest's own nesting limit stays far away)
MAX_NBYTES = 1 << 20  # metadata is read by every load of the step: keep it small
MAX_INT_BITS = 256  # an int far beyond this could not even be written as JSON text
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(metrics: Mapping[str, Any] | None,
           metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest ``meta`` fields for ``metrics`` and ``metadata`` (none for None), checked:
    a CkptError names the offending key and says what is accepted."""
    out: dict[str, Any] = {}
    if metrics is not None:
        out["metrics"] = {key: _metric_json(key, value)
                          for key, value in _mapping("metrics", metrics).items()}
    if metadata is not None:
        out["metadata"] = _json_value("metadata", _mapping("metadata", metadata), 0)
        nbytes = len(json.dumps(out["metadata"], separators=(",", ":")).encode())
        if nbytes > MAX_NBYTES:
            raise CkptError(f"save(metadata=...): {nbytes} bytes as JSON, more than {MAX_NBYTES}; "
                            "every load reads it with the manifest: store large things in the "
                            "state instead")
    return out


def read_metadata(path: str | os.PathLike[str], options: Options | None = None) -> dict[str, Any]:
    """The metrics and metadata stored with the checkpoint at ``path``, reading its manifest
    only: ``{"metrics": {name: float|int}, "metadata": {...}, "created_unix": float|None}``
    (empty dicts for a checkpoint saved without them, or before they existed). The manifest is
    checked as a load checks it (ManifestError if damaged); CheckpointNotFoundError /
    IncompleteCheckpointError if there is no committed checkpoint at ``path``."""
    store = store_for(checkpoint_path(path), options)
    where = store.path_of(manifest.MANIFEST_NAME)
    meta = manifest.decode(store.read_manifest(), where).meta
    metrics = meta.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ManifestError(f"{where}: meta.metrics is not an object; the checkpoint is damaged")
    metadata = meta.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: meta.metadata is not an object; the checkpoint is damaged")
    created = meta.get("created_unix")
    return {
        "metrics": {k: _metric_value(v, f"{where}: meta.metrics[{k!r}]")
                    for k, v in metrics.items()},
        "metadata": metadata,
        "created_unix": float(created) if isinstance(created, (int, float))
        and not isinstance(created, bool) else None,
    }


# -------------------------------------------------------------------- checks


def _mapping(what: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CkptError(f"save({what}=...): a dict of str keys, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise CkptError(f"save({what}=...): key {key!r} is not a str (JSON object keys are)")
    return value


def _metric_json(key: str, value: Any) -> int | float | str:
    if hasattr(value, "item") and callable(value.item):  # a 0-d tensor or numpy scalar
        try:
            value = value.item()
        except (RuntimeError, ValueError, TypeError):
            pass  # not one element: refused below
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CkptError(f"save(metrics=...): metrics[{key!r}] = {value!r:.60} is not a number "
                        "(int or float, or a one-element tensor); put other values in "
                        "metadata=")
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return _int_fits(f"metrics[{key!r}]", value)


def _int_fits(path: str, value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CkptError(f"save(...): {path} is an int of {value.bit_length()} bits, more than "
                        f"{MAX_INT_BITS}; store it as a string")
    return value


def _metric_value(value: Any, where: str) -> float | int:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ManifestError(f"{where} = {value!r:.60} is not a number; the checkpoint is "
                            "damaged or was written by something else")
    return value


def _json_value(path: str, value: Any, depth: int) -> Any:
    """``value`` as plain JSON (tuples as lists), or a CkptError naming ``path``."""
    if depth > MAX_DEPTH:
        raise CkptError(f"save(metadata=...): {path} nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _int_fits(path, value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CkptError(f"save(metadata=...): {path} = {value!r}; JSON has no NaN or "
                            "infinity: store it as a string, or as a metric (metrics= allows it)")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise CkptError(f"save(metadata=...): {path} has key {key!r}, not a str "
                                "(JSON object keys are)")
            out[key] = _json_value(f"{path}[{key!r}]", v, depth + 1)
        return out
    raise CkptError(f"save(metadata=...): {path} is a {type(value).__name__}, not a JSON value "
                    "(None, bool, int, float, str, list, dict); convert it first (e.g. "
                    "str(path), dataclasses.asdict(config))")
