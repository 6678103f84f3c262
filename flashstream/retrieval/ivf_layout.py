"""Where an IVF index file keeps its inverted lists, found without reading them.

FAISS writes an IVF index as a header (the IVF fields, the coarse quantizer, the codec's
parameters) and then its inverted lists as an ``ilar`` block: ``nlist`` and ``code_size``,
the list sizes (``full``: one per list; ``sprs``: (list, size) pairs of the non-empty ones),
then each non-empty list's codes (n x code_size) followed by its ids (n x int64), packed and
unaligned. The header's length depends on the quantizer and codec, so FAISS itself parses it
(through a reader that fetches the file's bytes as FAISS asks for them) and stops at the
``ilar`` tag; the list table after it is parsed here and checked against the file's size
before anything trusts it. Offsets then follow from the sizes, and the caller checks them once
more against where FAISS's own zero-copy load points each list (:func:`check_views`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import IndexFormatError

__all__ = ["LayoutUnknown", "ListLayout", "check_views", "find_lists_tag", "parse_lists"]

_ILAR = b"ilar"
_ID_BYTES = 8  # faiss idx_t


class LayoutUnknown(Exception):
    """The file is valid as far as FAISS goes, but not laid out as this module knows (a newer
    or another list format): serve it some other way, never by guessing offsets."""


class _Found(Exception):
    def __init__(self, offset: int) -> None:
        super().__init__(offset)
        self.offset = offset


@dataclass(frozen=True)
class ListLayout:
    """The inverted lists of one IVF index file.

    ``offsets[i]`` is the file offset of list i's codes, its ids follow them; ``nbytes[i]`` is
    the list's whole length (codes and ids); lists are in file order, each starting where the
    previous one ended, from ``data_start`` to the end of the file."""

    path: str
    file_size: int
    table_start: int   # offset of the "ilar" tag
    data_start: int    # offset of the first list byte (the end of everything FAISS parses)
    code_size: int
    sizes: np.ndarray    # vectors per list (int64)
    offsets: np.ndarray  # int64
    nbytes: np.ndarray   # int64

    @property
    def nlist(self) -> int:
        return len(self.sizes)

    def ends(self) -> np.ndarray:
        return self.offsets + self.nbytes


def find_lists_tag(faiss: Any, path: str, size: int,
                   read_at: Callable[[int, int], bytes]) -> int:
    """The offset of the ``ilar`` tag: FAISS parses the header from ``read_at(offset, n)``
    (which fetches and returns the file's bytes) and is stopped when it reads the tag.

    IndexFormatError when FAISS cannot parse the header (a truncated or corrupt file);
    LayoutUnknown when it gets through without meeting an ``ilar`` tag."""
    position = 0

    def feed(n: int) -> bytes:
        nonlocal position
        data = read_at(position, min(n, max(0, size - position)))
        if n == 4 and data == _ILAR:  # FAISS reads each 4-byte tag on its own
            raise _Found(position)
        position += len(data)
        return data

    try:
        faiss.read_index(faiss.PyCallbackIOReader(feed))
    except _Found as found:
        return found.offset
    except RuntimeError as e:
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise IndexFormatError(path, f"FAISS cannot read its header at offset {position} "
                                     f"(truncated or corrupt?): {detail}") from None
    raise LayoutUnknown(f"FAISS read {position} bytes without an 'ilar' list table")


def parse_lists(path: str, size: int, table_start: int,
                read_at: Callable[[int, int], bytes]) -> ListLayout:
    """The list table at ``table_start`` (see the module docstring), checked against the
    file's ``size``: IndexFormatError naming the list and offset when the table does not fit
    the file."""
    at = table_start

    def take(n: int, what: str) -> bytes:
        nonlocal at
        data = read_at(at, n) if at + n <= size else b""
        if len(data) != n:
            raise IndexFormatError(path, f"the file ends inside the inverted lists' {what} "
                                         f"at offset {at} ({size} bytes: truncated or "
                                         f"corrupt?)")
        at += n
        return data

    if take(4, "tag") != _ILAR:
        raise LayoutUnknown(f"no 'ilar' tag at offset {table_start}")
    nlist, code_size = struct.unpack("<QQ", take(16, "header"))
    if not 0 < nlist <= size:
        raise IndexFormatError(path, f"{nlist} lists in the list table at offset "
                                     f"{table_start} is not plausible for a {size}-byte file")
    if not 0 < code_size <= size:
        raise IndexFormatError(path, f"code size {code_size} at offset {table_start + 12} is "
                                     f"not plausible for a {size}-byte file")
    kind = take(4, "size table tag")
    (n,) = struct.unpack("<Q", take(8, "size table length"))
    if kind not in (b"full", b"sprs"):
        raise LayoutUnknown(f"list size table of kind {kind!r} at offset {at - 12}")
    if n * 8 > size:
        raise IndexFormatError(path, f"list size table at offset {at - 8} claims {n} entries, "
                                     f"more than a {size}-byte file holds")
    table_at = at
    values = np.frombuffer(take(8 * n, "size table"), dtype="<u8")
    sizes = _sizes(path, kind, values, nlist, table_at)
    per_vector = code_size + _ID_BYTES
    limit = np.uint64(size // per_vector)
    if (sizes > limit).any():
        bad = int(np.argmax(sizes > limit))
        raise IndexFormatError(path, f"list {bad}: size {int(sizes[bad])} in the list size "
                                     f"table at offset {table_at} is more than a {size}-byte "
                                     f"file holds (truncated or corrupt?)")
    nbytes = sizes.astype(np.int64) * per_vector
    ends = at + np.cumsum(nbytes)
    if len(ends) and ends[-1] > size:
        bad = int(np.argmax(ends > size))
        raise IndexFormatError(path, f"the lists need {int(ends[-1] - at)} bytes from offset "
                                     f"{at} but the file ends at {size} (truncated or corrupt? "
                                     f"the list size table is at offset {table_at}); list "
                                     f"{bad} at offset {int(ends[bad] - nbytes[bad])} is the "
                                     f"first past the end")
    end = int(ends[-1]) if len(ends) else at
    if end != size:
        raise LayoutUnknown(f"{size - end} bytes follow the last list (offset {end}): a "
                            f"layout with data after the lists")
    return ListLayout(path, size, table_start, at, int(code_size), sizes.astype(np.int64),
                      (ends - nbytes).astype(np.int64), nbytes)


def _sizes(path: str, kind: bytes, values: np.ndarray, nlist: int, at: int) -> np.ndarray:
    if kind == b"full":
        if len(values) != nlist:
            raise IndexFormatError(path, f"list size table at offset {at} has {len(values)} "
                                         f"sizes for {nlist} lists")
        return values.copy()
    if len(values) % 2:
        raise IndexFormatError(path, f"sparse list size table at offset {at} has an odd "
                                     f"length {len(values)}")
    lists, counts = values[0::2], values[1::2]
    if (lists >= nlist).any():
        bad = int(np.argmax(lists >= nlist))
        raise IndexFormatError(path, f"sparse list size table at offset {at} names list "
                                     f"{int(lists[bad])} of {nlist}")
    sizes = np.zeros(nlist, dtype=np.uint64)
    sizes[lists.astype(np.int64)] = counts
    return sizes


def check_views(layout: ListLayout, lists: Any, base: int) -> None:
    """LayoutUnknown unless FAISS's zero-copy load (``lists``: its ArrayInvertedLists over the
    image at address ``base``) put every list where ``layout`` says, sizes included."""
    for i in range(layout.nlist):
        n = int(lists.list_size(i))
        if n != int(layout.sizes[i]):
            raise LayoutUnknown(f"list {i}: FAISS reads {n} vectors, the table says "
                                f"{int(layout.sizes[i])}")
        if n == 0:
            continue
        codes, ids = int(lists.get_codes(i)), int(lists.get_ids(i))
        start = base + int(layout.offsets[i])
        if codes != start or ids != start + n * layout.code_size:
            raise LayoutUnknown(f"list {i}: FAISS does not point into the file image at "
                                f"offset {int(layout.offsets[i])} (it copied the list?)")
