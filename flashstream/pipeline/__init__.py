"""webdataset's pipeline API on flashstream streams: ``ShardStream`` (the shard source with the
fluid methods), ``Pipeline``, ``DataPipeline``, ``WebDataset`` / ``WebLoader``, tensor batches,
and webdataset's own pipelines where flashstream cannot read (``explain()`` says which). A layer
above ``flashstream.stream``."""

from .compat import DataPipeline, WebDataset, WebLoader
from .explain import Explanation
from .fallback import WebdatasetDataset, WebdatasetPipeline
from .pipeline import EpochSpec, Pipeline
from .shard_stream import ShardStream
from .stages import Batch, Each, Opaque, Slice, Unbatch

__all__ = ["Batch", "DataPipeline", "Each", "EpochSpec", "Explanation", "Opaque", "Pipeline",
           "ShardStream", "Slice", "Unbatch", "WebDataset", "WebLoader", "WebdatasetDataset",
           "WebdatasetPipeline"]
