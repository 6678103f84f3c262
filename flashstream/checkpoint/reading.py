"""Reading a checkpoint's tensors straight into memory of their own, a window at a time.

``load_checkpoint`` used to read the whole file into one buffer and hand out tensors that were
views of it. Cheap, but anything that kept one tensor (an optimizer keeps its moments) kept
the whole buffer alive: a 768 MiB model + AdamW checkpoint left RSS 260 MiB above torch.load's
for the rest of training. Here every tensor gets its own storage (or is the caller's own
tensor, for ``into=``) and the file streams through the engine's reader with aligned
O_DIRECT requests kept in flight: the only memory beyond the tensors themselves is the read
window (``queue_depth x chunk_size``), whatever the checkpoint's size. CRC-32C is checked as
the bytes go by, so a bad tensor is named before anything is returned. Pieces bound for a
CUDA tensor go through pinned buffers to the device (device_feed.py), overlapping the reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import engine
from ..errors import ChecksumError
from ..settings import IOSettings
from .device_feed import DeviceFeeds
from .format import PREFIX, StoredTensor, parse_header

__all__ = ["READ_WINDOW", "bytes_of", "read_header", "read_tensors"]

_CHUNK = 4 << 20
_DEPTH = 8
#: Bytes in flight while a checkpoint streams in: the load's memory beyond its tensors.
READ_WINDOW = _CHUNK * _DEPTH


def read_header(file: Path) -> Tuple[int, Dict[str, str], List[StoredTensor], bytes]:
    """(header_size, metadata, tensors, header bytes) with two small reads."""
    size = os.stat(file).st_size
    with open(file, "rb") as f:
        prefix = os.pread(f.fileno(), PREFIX.size, 0)
        if len(prefix) == PREFIX.size:
            (n,) = PREFIX.unpack(prefix)
            if n <= size - PREFIX.size:  # else parse_header says why (length past the end)
                prefix = os.pread(f.fileno(), PREFIX.size + n, 0)
            else:  # enough to recognise a torch.save file
                prefix += os.pread(f.fileno(), 64, PREFIX.size)
    header_size, metadata, tensors = parse_header(prefix, str(file), size)
    return header_size, metadata, tensors, prefix[:header_size]


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as flat uint8 (it must be contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def read_tensors(file: Path, tensors: Sequence[StoredTensor], dests: Dict[str, torch.Tensor],
                 io: IOSettings, *, verify: bool) -> None:
    """Fill ``dests[t.name]`` (contiguous, ``t``'s shape and dtype, any device) with each
    tensor's bytes; raises ChecksumError naming the first tensor whose CRC-32C differs."""
    order = sorted((t for t in tensors if t.end > t.begin), key=lambda t: t.begin)
    if not order:
        return
    targets = [bytes_of(dests[t.name]) for t in order]
    crcs: List[Optional[int]] = [0 if verify and t.crc is not None else None for t in order]
    start = order[0].begin // 4096 * 4096
    stop = max(t.end for t in order)
    settings = IOSettings(engine=io.engine, chunk_size=_CHUNK, queue_depth=_DEPTH,
                          direct=io.direct)
    reader = engine.open_reader([(str(file), start, stop)], settings)
    # Device targets: each piece's copy queued through pinned buffers, overlapping the reads.
    feeds = DeviceFeeds(settings.chunk_size) if any(t.is_cuda for t in targets) else None
    first = 0  # the first tensor not complete yet
    try:
        while first < len(order):
            chunk = reader.next()
            if chunk is None:
                raise OSError(f"{file}: ended at byte {start} while reading tensor "
                              f"{order[first].name!r} (the file shrank during the load?)")
            _, offset, data, _, _ = chunk
            end = offset + len(data)
            source = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
            i = first
            while i < len(order) and order[i].begin < end:
                t = order[i]
                lo, hi = max(t.begin, offset), min(t.end, end)
                if hi > lo:
                    dst = targets[i][lo - t.begin:hi - t.begin]
                    src = source[lo - offset:hi - offset]
                    if feeds is not None and dst.is_cuda:
                        feeds.copy(dst, src)
                    else:
                        dst.copy_(src)
                    if crcs[i] is not None:
                        crcs[i] = engine.crc32c(data[lo - offset:hi - offset], crcs[i])
                if t.end <= end:
                    if crcs[i] is not None and crcs[i] != t.crc:
                        raise ChecksumError(str(file), t.name, t.begin, t.end)
                    if i == first:
                        first += 1
                i += 1
            start = end
    finally:
        try:
            if feeds is not None:
                feeds.finish()  # no pinned buffer or destination is let go with a copy queued
        finally:
            reader.close()
