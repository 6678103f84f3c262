"""Tensor batches: what ``ShardStream.tensors(B)`` yields and the DataLoader carries.

A :class:`TensorBatch` is a dict: ``"__key__"`` and ``"__url__"`` are lists of strings; every
field (extension) is a uint8 tensor in one shared-memory slab: ``[B, n]`` when the field has
the same length ``n`` in every sample, else a :class:`Ragged` (all payloads back to back, and
``offsets``). Sent from a DataLoader worker, a batch crosses to the training loop as the slab's
file descriptor plus a small description: no payload is pickled or copied, and the slab is
reused once the training loop drops the batch's tensors (see slabs.py).
"""

from __future__ import annotations

import copy
import operator
import os
from multiprocessing import reduction
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .slabs import Lease, Slab, map_received, pool, received_lease

__all__ = ["FieldLayout", "Names", "Ragged", "TensorBatch", "build_batch", "for_loader"]


class Ragged(NamedTuple):
    """Payloads of different lengths: sample ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
    A sample without the field has an empty payload."""

    values: torch.Tensor  # uint8, every payload back to back
    offsets: torch.Tensor  # int64, B + 1

    def __len__(self) -> int:  # type: ignore[override]
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:  # type: ignore[override]
        """Sample ``i``'s payload (any integer, numpy and torch ones included), a view.
        (Iterating a Ragged gives its two tensors, as for any NamedTuple: torch's utilities
        rely on that; use ``split()`` for the samples.)"""
        if isinstance(i, slice):
            return tuple.__getitem__(self, i)
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"a Ragged is indexed by sample number, got {type(i).__name__}; "
                            f"use .split() for all samples") from None
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of a batch of {len(self)}")
        return self.values[int(self.offsets[i]):int(self.offsets[i + 1])]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def split(self) -> List[torch.Tensor]:
        """Each sample's payload as a uint8 tensor viewing the batch (no copy)."""
        return list(torch.split(self.values, self.lengths().tolist()))

    def tolist(self) -> List[bytes]:
        """Each sample's payload as ``bytes`` (copies, as the per-sample path gives them)."""
        data = self.values.numpy().tobytes()
        bounds = self.offsets.tolist()
        return [data[a:b] for a, b in zip(bounds, bounds[1:])]

    def pin_memory(self, device: Any = None) -> Ragged:
        return Ragged(self.values.pin_memory(), self.offsets.pin_memory())


class Names:
    """A list of strings on its way out of a DataLoader worker: it unpickles as a plain
    ``list``. It is not a Sequence, so the DataLoader's ``default_convert`` does not walk it
    string by string (a cost per batch that shows in the tensor path's CPU per GB)."""

    __slots__ = ("items",)

    def __init__(self, items: List[str]) -> None:
        self.items = items

    def __reduce__(self) -> Any:
        return (list, (self.items,))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __iter__(self) -> Any:
        return iter(self.items)

    def __eq__(self, other: object) -> bool:
        return self.items == (other.items if isinstance(other, Names) else other)

    def __repr__(self) -> str:
        return repr(self.items)


def for_loader(batch: Any) -> Any:
    """A batch about to leave a DataLoader worker: marked to travel by slab (any other pickle
    of it copies its tensors), with its key and url lists as :class:`Names`."""
    if isinstance(batch, TensorBatch):
        batch = copy.copy(batch)
        batch._outgoing = True
        for name in ("__key__", "__url__"):
            if isinstance(batch.get(name), list):
                batch[name] = Names(batch[name])
    return batch


class FieldLayout(NamedTuple):
    """Where one field lies in a slab: ``nbytes`` from ``offset``; ``lengths`` per sample
    (-1: absent)."""

    name: str
    offset: int
    nbytes: int
    lengths: np.ndarray


def _field(lease_array: np.ndarray, layout: FieldLayout) -> Any:
    lengths = layout.lengths
    count = len(lengths)
    if layout.nbytes:
        data = torch.frombuffer(lease_array, dtype=torch.uint8, count=layout.nbytes,
                                offset=layout.offset)
    else:
        data = torch.empty(0, dtype=torch.uint8)
    if count and lengths.min() >= 0 and (lengths == lengths[0]).all():
        return data.view(count, int(lengths[0]))
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
    return Ragged(data, torch.from_numpy(offsets))


def build_batch(lease: Lease, fields: Sequence[FieldLayout], plain: Dict[str, Any],
                wire: Optional[Tuple[Slab, int]] = None) -> TensorBatch:
    """A batch whose fields view ``lease``'s slab. ``wire``: (slab, generation) when this
    process owns the slab, so that the batch can be sent by descriptor."""
    batch = TensorBatch(plain)
    for layout in fields:
        batch[layout.name] = _field(lease.array, layout)
    if wire is not None:
        batch._wire = _Wire(wire[0], wire[1], tuple(fields), lease,
                            {layout.name: batch[layout.name] for layout in fields})
    return batch


class _Wire(NamedTuple):
    """What sending a batch by slab needs: the slab, its generation, the fields' layout, the
    lease, and the objects the fields started as (a field replaced since goes by pickle)."""

    slab: Slab
    generation: int
    fields: Tuple[FieldLayout, ...]
    lease: Lease
    originals: Dict[str, Any]


def _rebuild(fd: Any, size: int, key: Tuple[int, int], owner: int, dropped: List[int],
             generation: int, fields: Tuple[FieldLayout, ...], plain: Dict[str, Any]
             ) -> TensorBatch:
    mapping = map_received(fd, size, key, owner, dropped)
    return build_batch(received_lease(mapping, generation), fields, plain)


def _same(value: Any, original: Any) -> bool:
    """The field still holds what the slab describes (the DataLoader's default_convert
    rebuilds a Ragged around the same two tensors)."""
    if value is original:
        return True
    return (isinstance(value, Ragged) and isinstance(original, Ragged)
            and value.values is original.values and value.offsets is original.offsets)


class TensorBatch(dict):
    """A dict of a batch's fields (see the module docstring)."""

    _wire: Optional[_Wire] = None
    _outgoing = False  # set by for_loader: this copy leaves a DataLoader worker by slab

    def __reduce__(self) -> Any:
        wire = self._wire
        if wire is None or not self._outgoing or wire.slab.owner != os.getpid():
            # Anything but a batch leaving a DataLoader worker: plain tensors, which torch
            # pickles itself (this process may go on using them).
            return (TensorBatch, (dict(self),))
        sent = tuple(f for f in wire.fields if _same(self.get(f.name), wire.originals[f.name]))
        names = {f.name for f in sent}
        rest = {k: v for k, v in self.items() if k not in names}
        slab = wire.slab
        fd = None if slab.mapped_by_receiver else reduction.DupFd(slab.fd)
        wire.lease.hand_over()  # the receiver frees the slab; this process no longer may
        return (_rebuild, (fd, slab.size, slab.key, slab.owner, pool().dropped(),
                           wire.generation, sent, rest))

    def __copy__(self) -> TensorBatch:
        # The DataLoader's default_convert copies each item: keep what sending it needs.
        clone = TensorBatch(self)
        clone._wire, clone._outgoing = self._wire, self._outgoing
        return clone

    def __deepcopy__(self, memo: Dict[int, Any]) -> TensorBatch:
        return TensorBatch({k: copy.deepcopy(v, memo) for k, v in self.items()})

    def pin_memory(self, device: Any = None) -> TensorBatch:
        """Pinned copies of the tensors (the DataLoader's ``pin_memory=True``); the slab is
        free again once this batch is dropped."""
        return TensorBatch({k: v.pin_memory() if hasattr(v, "pin_memory") else v
                            for k, v in self.items()})

    @property
    def size(self) -> int:
        return len(self.get("__key__", ()))
