"""Copies of device (CUDA) tensors into staging: on a side stream, ordered after the producer.

The training loop queues its kernels on each device's *current* stream; the values a save must
capture are those after everything already queued there. So each device's copies go on one
side stream of ours that first waits on the current stream (``side.wait_stream(current)``):
ordered after the producer, without a device-wide synchronize and without queueing the copies
behind later work on the training stream. ``save`` then waits for the side streams alone
(the documented contract: the copy is done when ``save`` returns), so the next optimizer step
cannot race the copy, and the sources need no ``record_stream`` (their memory cannot be
reused by the allocator while the copy still reads it, since the copy has finished).

The ordering is written against a small ``Streams`` interface so that it is tested without a
GPU (tests/test_device_copy.py drives it with fakes that record each call); ``CudaStreams`` is
the real one.
"""

from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Protocol, Sequence, Tuple

import torch

__all__ = ["CudaStreams", "Streams", "cuda_streams", "enqueue_copies", "wait_copies"]


class Streams(Protocol):
    """What the ordering needs from a device runtime."""

    def current(self, device: Any) -> Any:
        """The producer's stream on ``device`` (has ``synchronize``)."""

    def side(self, device: Any) -> Any:
        """Our copy stream on ``device`` (has ``wait_stream``, ``synchronize`` and
        ``record_event``, whose event has ``synchronize``); reused."""

    def use(self, stream: Any) -> ContextManager[Any]:
        """Make ``stream`` current inside the block (temporaries are allocated on it)."""


class CudaStreams:
    """One side stream per CUDA device, made on first use in this process and kept."""

    def __init__(self) -> None:
        self._side: Dict[torch.device, Any] = {}

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def side(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def use(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)


_cuda = CudaStreams()


def cuda_streams() -> CudaStreams:
    """This process's side streams (CUDA cannot be used across fork, so no pid check)."""
    return _cuda


def enqueue_copies(jobs: Sequence[Tuple[Any, Any]], streams: Streams) -> List[Any]:
    """Queue ``dst.copy_(src, non_blocking=True)`` for each (dst, src), grouped by the source's
    device, each group on that device's side stream after it waited on the current stream.
    Returns the side streams used (for ``wait_copies``); the copies are not done yet."""
    groups: Dict[Any, List[Tuple[Any, Any]]] = {}
    for dst, src in jobs:
        groups.setdefault(src.device, []).append((dst, src))
    used = []
    for device, pairs in groups.items():
        side = streams.side(device)
        side.wait_stream(streams.current(device))  # after what the producer has queued
        with streams.use(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        used.append(side)
    return used


def wait_copies(sides: Sequence[Any]) -> None:
    """Wait for the queued copies: those streams only, never the whole device."""
    for side in sides:
        side.synchronize()
