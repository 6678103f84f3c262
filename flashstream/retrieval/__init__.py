"""Serving FAISS indexes from the drive: IVF lists fetched by O_DIRECT into a list cache, or
the file memory-mapped; every search timed."""

from .kinds import SUPPORTED
from .reader import IndexReader, write_index

__all__ = ["SUPPORTED", "IndexReader", "write_index"]
