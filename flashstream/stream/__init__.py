"""Streaming WebDataset tar shards: the shard source and the pieces it is built from.

``flashstream.ShardStream`` (the public class) is :class:`ShardSource` with webdataset's fluid
methods; it lives in the pipeline layer, above this one."""

from .dataset import ShardSource
from .handlers import ignore_and_continue, reraise_exception, warn_and_continue
from .samples import ReadStats

__all__ = ["ReadStats", "ShardSource", "ignore_and_continue", "reraise_exception",
           "warn_and_continue"]
