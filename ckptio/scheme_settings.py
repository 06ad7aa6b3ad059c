"""Options.storage once made: SchemeSettings, each storage scheme's settings by scheme name.

Call order: Options.__post_init__ (options.py) checks that ``storage`` is a mapping and wraps it
here; a scheme's registry entry reads its settings back through Options.settings
(storage/select.settings_for). The wrapper keeps what Options promises of every field: it is
read-only, and hashable (by its scheme names), so that Options stays a frozen, hashable value.
Scheme names are kept in lower case.

Owns: that read-only mapping. Does not own: what a scheme's settings hold (its own folder:
storage/s3/settings.py), the check against the older ``s3_*`` fields (options.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SchemeSettings"]


class SchemeSettings(Mapping[str, Any]):
    """Options.storage once made: read-only and hashable (by its schemes), as Options is."""

    def __init__(self, given: Mapping[str, Any]) -> None:
        self._items = {str(k).lower(): v for k, v in given.items()}

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items)))

    def __repr__(self) -> str:
        return repr(self._items)
