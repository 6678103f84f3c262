"""Staging memory: the reused, aligned host buffer each checkpoint is snapshotted into.

The buffer holds the exact image of the file (header region, then tensor data, then padding to
the O_DIRECT alignment), so the background writer hands it to the engine as it is. It is kept
between saves and only grows: the first save pays for mapping the pages in, later ones copy
into memory that is already mapped. With CUDA present it is pinned (page-locked), so
device-to-host copies run asynchronously at full PCIe speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from .. import engine
from .format import Layout

__all__ = ["StagingBuffer", "lost_tensors", "snapshot"]

_GROWTH = 1.125  # headroom so a state dict that grows a little does not reallocate every save
# Below this, a plain memcpy: torch's parallel copy_ pays an OpenMP barrier per tensor, which
# costs milliseconds when another process holds the other core (measured: 8 ms for 256 KiB).
_SMALL = 1 << 20


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
            # MAP_POPULATE faults every page in at once: about 4x faster here than letting
            # the first snapshot's copy fault them one by one (0.8 s vs 3.7 s for 2 GiB).
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | getattr(mmap, "MAP_POPULATE", 0))
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


def snapshot(layout: Layout, staging: StagingBuffer, mode: str = "copy") -> Optional[object]:
    """Snapshot every tensor of ``layout`` into its place in ``staging`` (the training stall).

    Non-contiguous views, any dtype, CPU or CUDA sources. CUDA copies are queued non-blocking
    on each tensor's current stream, then waited for. With ``mode="cow"``, contiguous CPU
    tensors are not copied now but write-protected (userfaultfd) and copied by a background
    thread; a write to a page not yet copied copies its block first. Either way, when this
    returns the caller may modify its tensors and staging ends up with the values as of now.

    Returns the pending copy-on-write snapshot (``wait()`` before reading staging; the sources
    must stay alive until then), or None when everything was copied.
    """
    staging.reserve(-(-layout.file_size // staging.alignment) * staging.alignment)
    base = layout.header_size
    lazy = mode == "cow" and engine.cow_available()
    ranges: List[Tuple[int, int, int]] = []
    streams: Dict[torch.device, object] = {}
    with torch.no_grad():
        for slot in layout.slots:
            if slot.nbytes == 0 or slot.source is None:
                continue
            src = slot.source.detach()
            start = base + slot.offset
            plain = src.device.type == "cpu" and src.is_contiguous()
            if plain and (lazy or slot.nbytes < _SMALL):
                if lazy:
                    ranges.append((src.data_ptr(), staging.tensor.data_ptr() + start,
                                   slot.nbytes))
                else:
                    ctypes.memmove(staging.tensor.data_ptr() + start, src.data_ptr(), slot.nbytes)
                continue
            dst = staging.tensor[start:start + slot.nbytes].view(src.dtype).view(src.shape)
            if src.is_cuda:
                streams.setdefault(src.device, torch.cuda.current_stream(src.device))
                dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src.to("cpu") if src.device.type != "cpu" else src)
    _wait(streams.values())
    pad_from = base + layout.data_size
    pad_to = -(-layout.file_size // staging.alignment) * staging.alignment
    staging.tensor[pad_from:pad_to].zero_()  # the tail request writes these; keep them clean
    return engine.cow_snapshot(ranges) if ranges else None


def lost_tensors(pending: Any, layout: Layout, staging: StagingBuffer) -> List[str]:
    """After ``pending.wait()``: names of the tensors a copy-on-write snapshot did not capture.

    The snapshot reports destination ranges (staging addresses), not sources: a source that was
    resized has another address by now, but its place in staging is fixed by the layout.
    """
    base = staging.tensor.data_ptr() + layout.header_size
    lost = [(addr - base, addr - base + length) for addr, length in pending.lost()]
    return [slot.name for slot in layout.slots
            if any(lo < slot.offset + slot.nbytes and slot.offset < hi for lo, hi in lost)]


def _wait(streams: Iterable[object]) -> None:
    for stream in streams:
        stream.synchronize()
