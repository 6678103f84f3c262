"""``ShardStream``: the shard source with webdataset's fluid methods.

The stream layer's :class:`~flashstream.stream.ShardSource` reads, plans and resumes; this
class adds ``.shuffle .decode .to_tuple .map .batched ...`` and ``.tensors(B)``, each returning
a resumable :class:`~flashstream.pipeline.Pipeline` built on the source's public interface.
"""

from __future__ import annotations

from typing import Any, Optional

from ..stream.dataset import ShardSource
from .fluid import FluidInterface
from .pipeline import EpochSpec, Pipeline
from .tensors import TensorSpec

__all__ = ["ShardStream"]


class ShardStream(FluidInterface, ShardSource):
    """Samples of WebDataset tar shards, read with aligned O_DIRECT requests kept in flight;
    a drop-in ``IterableDataset`` that resumes mid-epoch exactly.

    The constructor's arguments (``urls``, ``shuffle``, ``seed``, ``handler``, ``index``,
    ``split_by_rank``, ``split_by_worker``, ``equal_ranks``, ``batch_size``, ``lanes``,
    ``resampled``, ``shard_shuffle``, and the reader settings) are
    :class:`~flashstream.stream.ShardSource`'s; see there and docs/shardstream.md.

    webdataset's fluid methods (``.shuffle .decode .to_tuple .map .batched ...``) return a
    resumable ``flashstream.Pipeline``; ``.tensors(B)`` returns batches assembled straight from
    the read buffers into shared memory (see docs/pipeline.md and docs/tensors.md).
    """

    def _compose(self, *stages: Any) -> Pipeline:
        return Pipeline(self, stages)

    def _shuffled(self, size: int, original: Any = None, **kw: Any) -> ShardStream:
        return self.derive(shuffle_buffer=size)

    def _epoch(self, *, items: Optional[int], repetitions: int) -> Pipeline:
        return Pipeline(self, epoch=EpochSpec(items, repetitions))

    def with_length(self, n: int, silent: bool = False) -> Pipeline:
        """A pipeline of this stream whose ``len()`` is ``n`` (see Pipeline.with_length)."""
        return self._compose().with_length(n, silent=silent)

    def tensors(self, batch_size: int, *, partial: bool = True) -> Pipeline:
        """Batches of ``batch_size`` samples as shared-memory uint8 tensors, one per field,
        copied once from the read buffers (see docs/tensors.md)."""
        return Pipeline(self, tensors=TensorSpec(batch_size, partial))
