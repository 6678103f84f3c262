"""Tensor batches in reusable shared memory: what ``ShardStream.tensors(B)`` yields."""

from .batch import FieldLayout, Names, Ragged, TensorBatch, build_batch, for_loader
from .slabs import HEADER, pool

__all__ = ["HEADER", "FieldLayout", "Names", "Ragged", "TensorBatch", "build_batch", "for_loader",
           "pool"]
