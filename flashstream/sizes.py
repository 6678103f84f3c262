"""Byte sizes given as ints or strings like ``"64MiB"``."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["Size", "parse_size", "format_size"]

Size = Union[int, str]

_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Size, *, name: str = "size") -> int:
    """Return ``value`` in bytes: an int, or a string such as ``"8MiB"``, ``"1.5GB"``, ``"4k"``.

    Raises ``ValueError`` naming the argument and the accepted units for anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or a string like '8MiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS:
            return int(float(match.group(1)) * _UNITS[unit])
    units = ", ".join(u for u in ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"))
    raise ValueError(f"{name}: cannot parse {value!r} as a size; use an int or a number with "
                     f"one of the units {units}")


def format_size(n: float) -> str:
    """Human-readable binary size, e.g. ``4.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
