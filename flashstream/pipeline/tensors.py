"""``.tensors(B)``: a pipeline whose source yields tensor batches (see flashstream.batches).

With the sample plan (an index, the default) batches are packed from the read buffers by the
C++ core (``flashstream.stream.packed``). Without one (``index=False``, resampled shards) they
are assembled in Python from the per-sample path's dicts: the same batches, slower.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from ..batches import HEADER, FieldLayout, TensorBatch, build_batch, pool
from ..stream.packed import PackedPass

__all__ = ["TensorSpec", "pack_samples"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Batches of ``size`` samples; ``partial``: keep a last batch that is short."""

    size: int
    partial: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensors() needs a batch size >= 1, got {self.size!r}")
        if not isinstance(self.partial, bool):
            raise ValueError(f"partial must be True or False, got {self.partial!r}")

    def describe(self) -> str:
        return f"tensors({self.size},partial={self.partial})"

    def open(self, stream: Any, *, length: Optional[int] = None, repeat: int = 0) -> Any:
        work = stream.open_pass(length=length, repeat=repeat)
        if stream.plan == "samples":
            return PackedPass(work, self.size, self.partial)
        return _GroupedPass(work, self.size, self.partial)


class _GroupedPass:
    """Shard plan: the pass's samples, ``size`` at a time, packed in Python."""

    def __init__(self, work: Any, size: int, partial: bool) -> None:
        self.work, self.size, self.partial = work, size, partial

    @property
    def epoch(self) -> int:
        return self.work.epoch

    def state(self) -> Dict[str, object]:
        return self.work.state()

    def generate(self) -> Iterator[TensorBatch]:
        group: List[Dict] = []
        for sample in self.work.generate():
            group.append(sample)
            if len(group) == self.size:
                yield pack_samples(group)
                group = []
        if group and self.partial:
            yield pack_samples(group)


def pack_samples(samples: List[Dict]) -> TensorBatch:
    """A TensorBatch of per-sample dicts (fields in order of first appearance)."""
    names: List[str] = []
    for sample in samples:
        names += [k for k in sample if not k.startswith("__") and k not in names]
    sizes = {n: [len(s[n]) if n in s else -1 for s in samples] for n in names}
    total = sum(max(0, x) for n in names for x in sizes[n])
    slab, generation = pool().take(HEADER + total)
    array = np.frombuffer(slab.map, dtype=np.uint8)
    layouts, at = [], HEADER
    for name in names:
        start = at
        for sample in samples:
            data = sample.get(name, b"")
            array[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
            at += len(data)
        layouts.append(FieldLayout(name, start, at - start, np.asarray(sizes[name], np.int64)))
    plain = {"__key__": [s["__key__"] for s in samples],
             "__url__": [s.get("__url__") for s in samples]}
    return build_batch(pool().lease(slab, generation), layouts, plain, wire=(slab, generation))
