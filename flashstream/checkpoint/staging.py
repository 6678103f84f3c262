"""Staging memory: the reused, aligned host buffer each checkpoint is snapshotted into.

The buffer holds the exact image of the file (header region, then tensor data, then padding to
the O_DIRECT alignment), so the background writer hands it to the engine as it is. It is kept
between saves and only grows: the first save pays for faulting the pages in, later ones copy
into memory that is already mapped. With CUDA present it is pinned (page-locked), so
device-to-host copies run asynchronously at full PCIe speed.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Dict, Iterable, Optional

import numpy as np
import torch

from .format import Layout

__all__ = ["StagingBuffer", "snapshot"]

_GROWTH = 1.125  # headroom so a state dict that grows a little does not reallocate every save


class StagingBuffer:
    """An aligned host buffer, pinned when CUDA is available; grows on demand."""

    def __init__(self, *, pinned: Optional[bool] = None, alignment: int = 4096) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.alignment = alignment
        self._map: Optional[mmap.mmap] = None
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the whole buffer as bytes
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def reserve(self, size: int) -> None:
        """Make room for ``size`` bytes (contents are not kept when it grows)."""
        if size <= self.capacity:
            return
        size = -(-int(size * _GROWTH) // self.alignment) * self.alignment
        self.release()
        if self.pinned:
            # cudaHostAlloc memory is page-aligned, which is what O_DIRECT needs.
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults on the first save
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.allocations += 1

    def view(self, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) as a numpy array over the same memory (what the engine takes)."""
        return self.tensor[start:stop].numpy()

    def release(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            # A view may still be alive somewhere (BufferError); the GC frees the map later.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def snapshot(layout: Layout, staging: StagingBuffer) -> None:
    """Copy every tensor of ``layout`` into its place in ``staging`` (the training stall).

    Non-contiguous views, any dtype, CPU or CUDA sources. CUDA copies are queued
    non-blocking on each tensor's current stream, then waited for, so when this returns the
    staging buffer holds the values as of now and the caller may modify its tensors.
    """
    staging.reserve(-(-layout.file_size // staging.alignment) * staging.alignment)
    base = layout.header_size
    streams: Dict[torch.device, object] = {}
    with torch.no_grad():
        for slot in layout.slots:
            if slot.nbytes == 0 or slot.source is None:
                continue
            src = slot.source.detach()
            dst = staging.tensor[base + slot.offset: base + slot.offset + slot.nbytes]
            dst = dst.view(src.dtype).view(src.shape)
            if src.is_cuda:
                streams.setdefault(src.device, torch.cuda.current_stream(src.device))
                dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src.to("cpu") if src.device.type != "cpu" else src)
    _wait(streams.values())
    pad_from = base + layout.data_size
    pad_to = -(-layout.file_size // staging.alignment) * staging.alignment
    staging.tensor[pad_from:pad_to].zero_()  # the tail request writes these; keep them clean


def _wait(streams: Iterable[object]) -> None:
    for stream in streams:
        stream.synchronize()
