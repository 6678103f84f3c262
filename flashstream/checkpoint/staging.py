"""Staging memory: the reused, aligned host buffer each checkpoint is snapshotted into.

The buffer holds the exact image of the file (header region, then tensor data, then padding to
the O_DIRECT alignment), so the background writer hands it to the engine as it is. It is kept
between saves and only grows: the first save pays for mapping the pages in, later ones copy
into memory that is already mapped. With CUDA present it is pinned (page-locked), so
device-to-host copies run asynchronously at full PCIe speed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any, List, Optional, Tuple

import numpy as np
import psutil
import torch

from .. import engine
from .device_copy import cuda_streams, enqueue_copies, wait_copies
from .format import Layout

__all__ = ["StagingBuffer", "lost_tensors", "snapshot"]

_GROWTH = 1.125  # headroom so a state dict that grows a little does not reallocate every save
# Smaller tensors are copied at once even with snapshot="cow": protecting them saves less
# than it costs (a tensor within one page cannot be protected at all; many small ones cost
# more through the copy-on-write path than copied in one call: docs/benchmarks.md, "Figures
# behind the defaults").
_COW_MIN = 64 << 10


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

    def reserve(self, size: int, *, populate: bool = True) -> None:
        """Make room for ``size`` bytes (contents are not kept when it grows). ``populate``:
        fault every page in now (else the first write to each page does, later)."""
        if size <= self.capacity:
            return
        size = -(-int(size * _GROWTH) // self.alignment) * self.alignment
        self.release()
        if self.pinned:
            # cudaHostAlloc memory is page-aligned, which is what O_DIRECT needs.
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            # MAP_POPULATE faults every page in at once, several times faster than letting
            # the first snapshot's copy fault them one by one (docs/benchmarks.md).
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            if populate:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(-1, size, flags=flags)
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


class _FreeCores:
    """How many threads the next copy may use: this one, plus the cores that sat idle since
    the last snapshot (system-wide, from /proc/stat). With a data loader or another job on the
    other cores, copying there only makes everyone wait on everyone."""

    def __init__(self) -> None:
        self._last = psutil.cpu_times()
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)

    def threads(self) -> int:
        now = psutil.cpu_times()
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (
            self._last.idle + getattr(self._last, "iowait", 0.0))
        total = sum(now) - sum(self._last)
        self._last = now
        idle_cores = psutil.cpu_count() * idle / total if total > 0 else 0.0
        return max(1, min(self._cores, 1 + int(idle_cores + 0.5)))


_free_cores: Optional[_FreeCores] = None


def copy_threads() -> int:
    """Threads for the next snapshot copy (see _FreeCores)."""
    global _free_cores
    if _free_cores is None:
        _free_cores = _FreeCores()
    return _free_cores.threads()


def snapshot(layout: Layout, staging: StagingBuffer, mode: str = "copy") -> Optional[object]:
    """Snapshot every tensor of ``layout`` into its place in ``staging`` (the training stall).

    Non-contiguous views, any dtype, CPU or CUDA sources. Contiguous CPU tensors are copied in
    one call to the engine (GIL released, on this thread plus the cores that were idle; not
    torch's OpenMP pool, whose per-tensor barrier stalls when other processes hold the cores).
    CUDA copies are queued non-blocking on a side stream per device, ordered after the work
    already queued on the current stream, and waited for (that stream only: device_copy.py). With
    ``mode="cow"`` (``WriterConfig.snapshot_mode`` decides "auto"), contiguous CPU tensors
    are not copied now but write-protected (userfaultfd) and copied by a background thread; a
    write to a page not yet copied copies its block first. Either way, when this returns the
    caller may modify its tensors and staging ends up with the values as of now.

    Returns the pending copy-on-write snapshot (``wait()`` before reading staging; the sources
    must stay alive until then), or None when everything was copied.
    """
    lazy = mode == "cow" and engine.cow_available()
    # With copy-on-write most bytes are copied in the background: let that copy fault the
    # staging pages in, not the stall (populating them is a large share of a first save).
    staging.reserve(-(-layout.file_size // staging.alignment) * staging.alignment,
                    populate=not lazy)
    base = layout.header_size
    into = staging.tensor.data_ptr() + base
    plain: List[int] = []  # (src, dst, len) triples, flattened
    protect: List[Tuple[int, int, int]] = []  # for the copy-on-write snapshot
    on_device: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (dst, src) of CUDA sources
    with torch.no_grad():
        for slot in layout.slots:
            src = slot.source
            if slot.nbytes == 0 or src is None:
                continue
            # Raw bytes are the values only without a lazy conjugate or negation bit.
            if src.is_cpu and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
                if lazy and slot.nbytes >= _COW_MIN:
                    protect.append((src.data_ptr(), into + slot.offset, slot.nbytes))
                else:
                    plain += (src.data_ptr(), into + slot.offset, slot.nbytes)
                continue
            src = src.detach()
            start = base + slot.offset
            dst = staging.tensor[start:start + slot.nbytes].view(src.dtype).view(src.shape)
            if src.is_cuda:
                on_device.append((dst, src))
            else:
                dst.copy_(src.to("cpu") if src.device.type != "cpu" else src)
    sides = enqueue_copies(on_device, cuda_streams()) if on_device else []
    pad_from = base + layout.data_size
    pad_to = -(-layout.file_size // staging.alignment) * staging.alignment
    staging.tensor[pad_from:pad_to].zero_()  # the tail request writes these; keep them clean
    if plain:
        engine.copy_ranges(np.array(plain, dtype=np.uint64), copy_threads())
    wait_copies(sides)
    return engine.cow_snapshot(protect) if protect else None


def lost_tensors(pending: Any, layout: Layout, staging: StagingBuffer) -> List[str]:
    """After ``pending.wait()``: names of the tensors a copy-on-write snapshot did not capture.

    The snapshot reports destination ranges (staging addresses), not sources: a source that was
    resized has another address by now, but its place in staging is fixed by the layout.
    """
    base = staging.tensor.data_ptr() + layout.header_size
    lost = [(addr - base, addr - base + length) for addr, length in pending.lost()]
    return [slot.name for slot in layout.slots
            if any(lo < slot.offset + slot.nbytes and slot.offset < hi for lo, hi in lost)]
