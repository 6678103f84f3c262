"""Serving FAISS indexes from the drive: a memory-mapped reader that times every search."""

from .kinds import SUPPORTED
from .reader import IndexReader, write_index

__all__ = ["SUPPORTED", "IndexReader", "write_index"]
