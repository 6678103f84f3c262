"""webdataset's pipeline API on flashstream streams: fluid methods, ``DataPipeline``,
``WebDataset`` / ``WebLoader``, and tensor batches. A layer above ``flashstream.stream``."""

from .compat import DataPipeline, WebDataset, WebLoader
from .pipeline import EpochSpec, Pipeline
from .stages import Batch, Each, Opaque, Unbatch

__all__ = ["Batch", "DataPipeline", "Each", "EpochSpec", "Opaque", "Pipeline", "Unbatch",
           "WebDataset", "WebLoader"]
