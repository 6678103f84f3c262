"""Streaming WebDataset tar shards: ShardStream and the pieces it is built from."""

from .dataset import ShardStream
from .handlers import ignore_and_continue, reraise_exception, warn_and_continue
from .samples import ReadStats

__all__ = ["ReadStats", "ShardStream", "ignore_and_continue", "reraise_exception",
           "warn_and_continue"]
