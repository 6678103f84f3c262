"""Loads onto a GPU: each chunk's host-to-device copy queued while the next reads are in flight.

A load that read the whole state into ordinary host tensors and moved it to the device
afterwards paid for the copy on top of the read: a pageable copy is synchronous and staged
by the driver, after the last byte arrived. Here the tensors are allocated on the device
first, and each chunk the reader delivers is copied into one of a few pinned (page-locked)
buffers, whose copy to the device is queued on a side stream, asynchronous DMA. The reader
keeps its requests in flight meanwhile, so the device copies hide behind the reads. A pinned
buffer is reused only once its previous copy is done (its event), and the load returns after
the side stream has finished, so its tensors are ready, as ``torch.load``'s are.

The side stream first waits on the device's current stream: the destination tensors were
just allocated there (their memory may have been freed by kernels still queued), and a load
``into`` a model's own tensors must not overtake the training step that last wrote them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .device_copy import CudaStreams, Streams

__all__ = ["DeviceFeed", "DeviceFeeds"]

#: Pinned buffers per device: enough that filling one never waits for a copy in progress.
SLOTS = 4

# The loads' own side streams, apart from the snapshots' (device_copy.cuda_streams()), so a
# load never waits for a save's copies or the reverse.
_load_streams = CudaStreams()


class DeviceFeed:
    """Copies of host bytes to one device through ``slots`` pinned buffers, on a side stream
    of ``streams`` (device_copy.Streams; its side streams also need ``record_event``)."""

    def __init__(self, device: Any, slot_bytes: int, streams: Streams, *, slots: int = SLOTS,
                 pin_memory: bool = True) -> None:
        self.stream = streams.side(device)
        self.stream.wait_stream(streams.current(device))  # see the module's docstring
        self._use = streams.use
        self.slot_bytes = slot_bytes
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
                       for _ in range(slots)]
        self._events: List[Optional[Any]] = [None] * slots
        self._next = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst[:] = src`` (flat uint8: ``dst`` on this device, ``src`` on the host,
        at most ``slot_bytes``); ``src`` may be reused as soon as this returns."""
        n = src.numel()
        if n > self.slot_bytes:
            raise ValueError(f"a piece of {n} bytes exceeds the pinned buffer "
                             f"({self.slot_bytes} bytes)")
        i = self._next
        self._next = (i + 1) % len(self._slots)
        if self._events[i] is not None:
            self._events[i].synchronize()  # its previous copy has left the buffer
        slot = self._slots[i][:n]
        slot.copy_(src)
        with self._use(self.stream):
            dst.copy_(slot, non_blocking=True)
        self._events[i] = self.stream.record_event()

    def finish(self) -> None:
        """Wait for every queued copy."""
        self.stream.synchronize()


class DeviceFeeds:
    """One :class:`DeviceFeed` per device a load writes to, made on first use."""

    def __init__(self, slot_bytes: int, streams: Optional[Streams] = None, *,
                 pin_memory: bool = True) -> None:
        self.slot_bytes = slot_bytes
        self._streams = streams if streams is not None else _load_streams
        self._pin_memory = pin_memory
        self._feeds: Dict[Any, DeviceFeed] = {}

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        feed = self._feeds.get(dst.device)
        if feed is None:
            feed = self._feeds[dst.device] = DeviceFeed(
                dst.device, self.slot_bytes, self._streams, pin_memory=self._pin_memory)
        feed.copy(dst, src)

    def finish(self) -> None:
        for feed in self._feeds.values():
            feed.finish()
