"""The FAISS index types IndexReader serves, recognised by the 4-byte tag a FAISS file starts with.

Checking the tag first gives a clear error for an unsupported or foreign file before FAISS
reads (or maps) gigabytes of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict

from ..errors import IndexFormatError

__all__ = ["SUPPORTED", "IndexKind", "kind_of", "kind_of_tag"]


@dataclass(frozen=True)
class IndexKind:
    name: str          # the faiss class, as users know it
    ivf: bool          # has inverted lists (nprobe applies)
    hnsw: bool         # has an HNSW graph (efSearch applies)


_FLAT = IndexKind("IndexFlat", ivf=False, hnsw=False)
# fourcc -> kind. IndexFlat's tag encodes its metric: IxF2 (L2), IxFI (inner product), IxFl.
_TAGS: Dict[bytes, IndexKind] = {
    b"IxF2": _FLAT,
    b"IxFI": _FLAT,
    b"IxFl": _FLAT,
    b"IwFl": IndexKind("IndexIVFFlat", ivf=True, hnsw=False),
    b"IwPQ": IndexKind("IndexIVFPQ", ivf=True, hnsw=False),
    b"IwSq": IndexKind("IndexIVFScalarQuantizer", ivf=True, hnsw=False),
    b"IHNf": IndexKind("IndexHNSWFlat", ivf=False, hnsw=True),
}

#: The index types IndexReader serves.
SUPPORTED = ("IndexFlat", "IndexFlatL2", "IndexFlatIP", "IndexIVFFlat", "IndexIVFPQ",
             "IndexIVFScalarQuantizer", "IndexHNSWFlat")


def kind_of(path: str) -> IndexKind:
    """The kind of the FAISS index in ``path``; IndexFormatError when it is none we serve."""
    with open(path, "rb") as f:  # FileNotFoundError / PermissionError name the path
        tag = f.read(4)
        size = os.fstat(f.fileno()).st_size
    return kind_of_tag(path, tag, size)


def kind_of_tag(path: str, tag: bytes, size: int) -> IndexKind:
    """The kind for the first bytes ``tag`` of the ``size``-byte file ``path`` (see kind_of)."""
    if len(tag) < 4:
        raise IndexFormatError(path, f"{size} bytes is too short for a FAISS index")
    kind = _TAGS.get(tag)
    if kind is None:
        shown = tag.decode("ascii", "backslashreplace")
        raise IndexFormatError(
            path, f"FAISS index type tag {shown!r} is not supported by IndexReader (or the "
                  f"file is not a FAISS index); supported: {', '.join(SUPPORTED)}")
    return kind
