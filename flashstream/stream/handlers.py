"""Error policies for bad shards, compatible with webdataset's ``handler=`` callables.

A handler receives the exception and returns True to skip the rest of that shard and go on,
False to end the stream quietly, or raises to propagate. As in webdataset, False ends only the
shard for damage webdataset meets inside its member loop or not at all (a ShardFormatError
marked ``shard_only``): see :func:`goes_on`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Union

__all__ = ["Handler", "goes_on", "ignore_and_continue", "reraise_exception", "resolve_handler",
           "warn_and_continue"]

Handler = Callable[[BaseException], bool]


def goes_on(handler: Handler, exn: BaseException) -> bool:
    """Ask ``handler`` about ``exn`` (it may raise): whether the stream goes on past the shard.
    A False verdict ends the stream, except on a shard that webdataset would end alone (a
    ShardFormatError's ``shard_only``: a cut inside a member's data, which webdataset's member
    loop hands to the handler, or damage tarfile takes for the archive's end)."""
    return bool(handler(exn)) or bool(getattr(exn, "shard_only", False))


def reraise_exception(exn: BaseException) -> bool:
    """Propagate the error (the default)."""
    raise exn


def warn_and_continue(exn: BaseException) -> bool:
    """Warn, skip the rest of the bad shard, go on with the next one."""
    warnings.warn(f"flashstream: skipping the rest of a shard: {exn}", stacklevel=2)
    return True


def ignore_and_continue(exn: BaseException) -> bool:
    """Skip the rest of the bad shard silently."""
    return True


_BY_NAME = {"reraise": reraise_exception, "warn": warn_and_continue,
            "ignore": ignore_and_continue}


def resolve_handler(handler: Union[str, Handler]) -> Handler:
    """A handler from a name (``reraise``, ``warn``, ``ignore``) or a callable."""
    if isinstance(handler, str):
        if handler not in _BY_NAME:
            raise ValueError(f"handler must be a callable or one of {', '.join(_BY_NAME)}; "
                             f"got {handler!r}")
        return _BY_NAME[handler]
    if not callable(handler):
        raise ValueError(f"handler must be a callable or one of {', '.join(_BY_NAME)}; "
                         f"got {handler!r}")
    return handler
