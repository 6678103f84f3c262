"""flashstream: PyTorch I/O for dense NVMe flash.

``ShardStream`` streams WebDataset tar shards with aligned O_DIRECT reads kept in flight by a
C++ engine (io_uring, or a pread thread pool), and yields exactly webdataset's samples; its
webdataset-style methods (``.decode().to_tuple().batched()``) return a resumable ``Pipeline``,
and ``.tensors(B)`` packs batches straight into shared memory. ``WebDataset``, ``WebLoader``
and ``DataPipeline`` are one-name swaps for webdataset's.
``CheckpointWriter`` snapshots training state and writes it in the background, paced and
crash-safe; ``load_checkpoint`` reads it back verified. ``IndexReader`` serves a FAISS index
memory-mapped from the drive and records every search's latency.
"""

from . import settings
from .checkpoint import (
    AdaptiveSettings,
    CheckpointWriter,
    SaveReport,
    list_checkpoints,
    load_checkpoint,
)
from .engine import engine_name, uring_available
from .errors import (
    ChecksumError,
    FlashstreamError,
    IndexFormatError,
    ShardFormatError,
    SnapshotLostError,
)
from .pipeline import DataPipeline, Explanation, Pipeline, ShardStream, WebDataset, WebLoader
from .retrieval import IndexReader, write_index
from .shard_writer import ShardWriter, TarWriter
from .sizes import parse_size
from .stream import (
    ReadStats,
    ignore_and_continue,
    reraise_exception,
    warn_and_continue,
)
from .telemetry import (
    DeviceInfo,
    EpochMonitor,
    EpochReport,
    LatencyHistogram,
    device_of,
    format_device,
)
from .telemetry.probe import probe

__version__ = "0.1.0"

__all__ = [
    "AdaptiveSettings",
    "CheckpointWriter",
    "DataPipeline",
    "ChecksumError",
    "DeviceInfo",
    "EpochMonitor",
    "EpochReport",
    "Explanation",
    "FlashstreamError",
    "IndexFormatError",
    "IndexReader",
    "LatencyHistogram",
    "Pipeline",
    "ReadStats",
    "SaveReport",
    "ShardFormatError",
    "SnapshotLostError",
    "TarWriter",
    "ShardStream",
    "ShardWriter",
    "device_of",
    "engine_name",
    "format_device",
    "ignore_and_continue",
    "list_checkpoints",
    "load_checkpoint",
    "parse_size",
    "probe",
    "reraise_exception",
    "settings",
    "uring_available",
    "write_index",
    "warn_and_continue",
    "WebDataset",
    "WebLoader",
]
