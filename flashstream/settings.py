"""Process-wide I/O settings: defaults, ``FLASHSTREAM_*`` environment variables, overrides.

Resolution order for each knob: an explicit keyword argument (e.g. ``ShardStream(engine=...)``),
then the innermost active :func:`override` block, then the environment variable, then the
default. Environment variables are read when a stream starts, so DataLoader workers see the
same values as the parent. All knobs are listed in ``docs/settings.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, List, Optional

from .sizes import Size, parse_size

__all__ = ["ENGINES", "IOSettings", "current", "override", "resolve"]

ENGINES = ("auto", "uring", "threads", "python")

_DEFAULTS = {"engine": "auto", "chunk_size": 1 << 20, "queue_depth": 32, "direct": True}
_ENV = {
    "engine": "FLASHSTREAM_ENGINE",
    "chunk_size": "FLASHSTREAM_CHUNK_SIZE",
    "queue_depth": "FLASHSTREAM_QUEUE_DEPTH",
    "direct": "FLASHSTREAM_DIRECT",
}
_overrides: List[dict] = []


@dataclasses.dataclass(frozen=True)
class IOSettings:
    """Validated reader settings.

    engine: ``auto`` (io_uring when the kernel and seccomp allow it, else ``threads``),
        ``uring``, ``threads`` (pread thread pool) or ``python`` (pure-Python reference).
    chunk_size: bytes per read request (int or ``"4MiB"``); rounded up to the O_DIRECT alignment.
    queue_depth: read requests kept in flight.
    direct: read with O_DIRECT where the filesystem allows it (buffered fallback otherwise).
    """

    engine: str = _DEFAULTS["engine"]
    chunk_size: int = _DEFAULTS["chunk_size"]
    queue_depth: int = _DEFAULTS["queue_depth"]
    direct: bool = _DEFAULTS["direct"]

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        object.__setattr__(self, "chunk_size", parse_size(self.chunk_size, name="chunk_size"))
        if not 4096 <= self.chunk_size <= 1 << 30:
            raise ValueError(f"chunk_size must be between 4KiB and 1GiB, got {self.chunk_size}")
        if isinstance(self.queue_depth, bool) or not isinstance(self.queue_depth, int) or not (
            1 <= self.queue_depth <= 256
        ):
            raise ValueError(f"queue_depth must be an int from 1 to 256, got {self.queue_depth!r}")
        if not isinstance(self.direct, bool):
            raise ValueError(f"direct must be True or False, got {self.direct!r}")


def _from_env(name: str) -> object:
    raw = os.environ.get(_ENV[name])
    if raw is None or raw == "":
        return _DEFAULTS[name]
    if name == "queue_depth":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{_ENV[name]} must be an integer, got {raw!r}") from None
    if name == "direct":
        flags = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        if raw.lower() not in flags:
            raise ValueError(f"{_ENV[name]} must be one of {', '.join(flags)}; got {raw!r}")
        return flags[raw.lower()]
    if name == "chunk_size":
        return parse_size(raw, name=_ENV[name])
    return raw.lower()


def current() -> IOSettings:
    """The settings in force now (environment, then active overrides)."""
    values = {name: _from_env(name) for name in _DEFAULTS}
    for layer in _overrides:
        values.update(layer)
    return IOSettings(**values)


def resolve(
    *,
    engine: Optional[str] = None,
    chunk_size: Optional[Size] = None,
    queue_depth: Optional[int] = None,
    direct: Optional[bool] = None,
) -> IOSettings:
    """``current()`` with explicit (non-None) arguments taking precedence."""
    given = {"engine": engine, "chunk_size": chunk_size, "queue_depth": queue_depth,
             "direct": direct}
    return dataclasses.replace(current(), **{k: v for k, v in given.items() if v is not None})


@contextlib.contextmanager
def override(**values: object) -> Iterator[IOSettings]:
    """Temporarily change settings for this process: ``with override(engine="threads"): ...``."""
    unknown = set(values) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)}; allowed: {', '.join(_DEFAULTS)}")
    _overrides.append(dict(values))
    try:
        yield current()  # validates the new values
    finally:
        _overrides.pop()
