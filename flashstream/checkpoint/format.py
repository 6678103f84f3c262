"""The checkpoint file: safetensors-compatible, with a 4 KiB-aligned data region.

Layout of one rank's file::

    [8-byte little-endian header length n][header JSON, space-padded][tensor data]
    |<-------------- header_size (a multiple of 4 KiB) ------------->|

The padding makes the data region start on an O_DIRECT boundary, so the staging buffer that
holds this exact image is written with aligned requests and no copy. Tensors follow each other
with no gaps (safetensors requires it), largest element size first, so every tensor starts at a
multiple of its element size and loads as a zero-copy view. Dtypes safetensors has no name for
(complex, ...) are stored as U8 bytes, with their real dtype and shape in the metadata.

Metadata (``__metadata__``, string values, as safetensors requires):
    format                  "pt"
    flashstream.version     format version, "1"
    flashstream.structure   the JSON skeleton of the state dict (see structure.py)
    flashstream.checksums   {"tensor name": "crc32c as 8 hex digits"} for every tensor
    flashstream.dtypes      {"tensor name": [torch dtype, shape]} for tensors stored as bytes
    flashstream.header_crc32c  the CRC-32C of the whole header (prefix, JSON and padding) with
                            this value's 8 hex digits read as "00000000": the header checks
                            itself, also in a file copied without its commit marker
    flashstream.step / .rank / .world_size
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import warnings
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import engine
from ..errors import ChecksumError
from .structure import TensorEntry

__all__ = ["FORMAT_VERSION", "HEADER_ALIGNMENT", "SAFETENSORS_MAX_HEADER", "Layout", "Slot",
           "StoredTensor", "check_header_crc", "header_bytes", "parse_header", "plan",
           "torch_dtype"]

FORMAT_VERSION = "1"
HEADER_ALIGNMENT = 4096
#: safetensors refuses headers longer than this (its MAX_HEADER_SIZE).
SAFETENSORS_MAX_HEADER = 100_000_000
PREFIX = struct.Struct("<Q")
_HEADER_CRC = b'"flashstream.header_crc32c":"'
_NO_CRC = "00000000"

# torch dtype -> safetensors dtype name.
_SAFETENSORS_NAMES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _torch_name, _st_name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                              ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _torch_name):
        _SAFETENSORS_NAMES[getattr(torch, _torch_name)] = _st_name
_FROM_SAFETENSORS = {name: dtype for dtype, name in _SAFETENSORS_NAMES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name or of a ``str(torch.dtype)``."""
    if name in _FROM_SAFETENSORS:
        return _FROM_SAFETENSORS[name]
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in the checkpoint header")
    return dtype


@dataclasses.dataclass
class Slot:
    """Where one tensor lives in the data region."""

    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "source")  # 50,000 per save

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int
    source: Optional[torch.Tensor]  # the caller's tensor; dropped once snapshotted

    @property
    def stored_as_bytes(self) -> bool:
        return self.dtype not in _SAFETENSORS_NAMES


@dataclasses.dataclass
class Layout:
    slots: List[Slot]
    metadata: Dict[str, str]  # without the checksums
    header_size: int
    data_size: int
    # Caches of header pieces that depend on the slots only (see _pieces).
    encoded_names: Optional[List[str]] = None
    tensors_json: Optional[str] = None
    checks_length: int = 0

    @property
    def file_size(self) -> int:
        return self.header_size + self.data_size

    def forget_sources(self) -> None:
        """Drop the references to the caller's tensors (after the snapshot)."""
        for slot in self.slots:
            slot.source = None

    def segment_bounds(self) -> List[int]:
        """Tensor boundaries within the data region: [0, end_1, ..., data_size]."""
        return [0] + [s.offset + s.nbytes for s in self.slots]


# The C encoder json.dumps uses for str (ASCII output, the same escapes).
_encode = json.encoder.encode_basestring_ascii


def plan(entries: Sequence[TensorEntry], metadata: Mapping[str, str]) -> Layout:
    """Place the tensors (largest element size first) and size the padded header."""
    order = sorted(entries, key=lambda e: -e.tensor.element_size())  # stable
    slots, offset = [], 0
    for entry in order:
        t = entry.tensor
        nbytes = t.numel() * t.element_size()
        slots.append(Slot(entry.name, t.dtype, tuple(t.shape), offset, nbytes, t))
        offset += nbytes
    layout = assemble(slots, metadata)
    if layout.header_size > SAFETENSORS_MAX_HEADER:
        warnings.warn(f"this checkpoint's header is {layout.header_size:,} bytes ({len(slots):,} "
                      f"tensors): flashstream loads it, but safetensors refuses headers over "
                      f"{SAFETENSORS_MAX_HEADER:,} bytes (safetensors.torch.load_file will "
                      f"fail); shorter or fewer tensor names keep it readable there",
                      stacklevel=3)
    return layout


def assemble(slots: List[Slot], metadata: Mapping[str, str],
             like: Optional[Layout] = None) -> Layout:
    """The layout of ``slots`` (placed already) with ``metadata``, its header sized. ``like``:
    an earlier layout with the same slots, whose cached header pieces are reused."""
    # The header's own checksum first: found at once, and its placeholder has its final width.
    meta = {"flashstream.header_crc32c": _NO_CRC, **metadata}
    if like is not None:
        if "flashstream.dtypes" in like.metadata:
            meta["flashstream.dtypes"] = like.metadata["flashstream.dtypes"]
    else:
        raw = {s.name: [str(s.dtype), list(s.shape)] for s in slots if s.stored_as_bytes}
        if raw:
            meta["flashstream.dtypes"] = json.dumps(raw)
    data_size = slots[-1].offset + slots[-1].nbytes if slots else 0
    layout = Layout(slots, meta, 0, data_size)
    if like is not None:
        layout.encoded_names, layout.tensors_json = like.encoded_names, like.tensors_json
        layout.checks_length = like.checks_length
    size_header(layout)
    return layout


def _pieces(layout: Layout) -> None:
    """Cache the header's parts that depend only on the slots (kept by ``relayout``)."""
    if layout.tensors_json is not None:
        return
    names = [_encode(s.name) for s in layout.slots]
    parts = []
    for s, n in zip(layout.slots, names):
        if s.stored_as_bytes:
            dtype, shape = "U8", str(s.nbytes)
        else:
            dtype, shape = _SAFETENSORS_NAMES[s.dtype], ",".join(map(str, s.shape))
        parts.append(f',{n}:{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":'
                     f'[{s.offset},{s.offset + s.nbytes}]}}')
    layout.encoded_names = names
    layout.tensors_json = "".join(parts)
    # Checksums are fixed-width hex: the encoded checksums string has this length for any.
    layout.checks_length = len(_encode(_checksums(names, [0] * len(names))))


def _checksums(names: Sequence[str], crcs: Sequence[int]) -> str:
    return "{" + ",".join(f'{n}:"{crc:08x}"' for n, crc in zip(names, crcs)) + "}"


_CHECKSUMS_KEY = _encode("flashstream.checksums")


def _metadata_json(metadata: Mapping[str, str]) -> str:
    return ",".join(f"{_encode(k)}:{_encode(v)}" for k, v in metadata.items())


def _header_json(layout: Layout, crcs: Sequence[int]) -> bytes:
    """The header as compact JSON, the bytes ``json.dumps(header, separators=(",", ":"))``
    gives, built from pieces: json.dumps of a 50,000-tensor header took 0.4 s of the stall."""
    _pieces(layout)
    checks = _encode(_checksums(layout.encoded_names, crcs))
    return (f'{{"__metadata__":{{{_metadata_json(layout.metadata)},{_CHECKSUMS_KEY}:{checks}}}'
            f'{layout.tensors_json}}}').encode()


def _header_length(layout: Layout) -> int:
    """len(_header_json(layout, any crcs)), without building the checksums."""
    _pieces(layout)
    return (len('{"__metadata__":{') + len(_metadata_json(layout.metadata)) + 1
            + len(_CHECKSUMS_KEY) + 1 + layout.checks_length + 1 + len(layout.tensors_json) + 1)


def size_header(layout: Layout) -> None:
    """Set ``layout.header_size``: the header padded so the data region starts aligned."""
    unpadded = _header_length(layout) + PREFIX.size
    layout.header_size = -(-unpadded // HEADER_ALIGNMENT) * HEADER_ALIGNMENT


def header_bytes(layout: Layout, crcs: Sequence[int]) -> bytes:
    """The first ``layout.header_size`` bytes of the file, with the tensors' checksums."""
    body = _header_json(layout, crcs)
    padded = body.ljust(layout.header_size - PREFIX.size, b" ")
    if len(padded) != layout.header_size - PREFIX.size:
        raise AssertionError("checkpoint header grew after layout")  # fixed-width checksums
    header = bytearray(PREFIX.pack(len(padded)) + padded)
    at = header.find(_HEADER_CRC) + len(_HEADER_CRC)
    header[at:at + 8] = f"{engine.crc32c(bytes(header)):08x}".encode()
    return bytes(header)


def check_header_crc(header: bytes, path: str) -> bool:
    """Verifies the header's own checksum; False for a header without one (written before it
    existed, or by another tool). Raises ChecksumError when it does not match."""
    at = header.find(_HEADER_CRC)
    if at < 0:
        return False
    at += len(_HEADER_CRC)
    recorded = bytes(header[at:at + 8])
    blank = bytearray(header)
    blank[at:at + 8] = _NO_CRC.encode()
    try:
        expected = int(recorded, 16)
    except ValueError:
        raise ChecksumError(path, "<header>", 0, len(header)) from None
    if engine.crc32c(bytes(blank)) != expected:
        raise ChecksumError(path, "<header>", 0, len(header))
    return True


@dataclasses.dataclass
class StoredTensor:
    """One tensor as the header describes it."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute file offsets
    end: int
    crc: Optional[int]


def _not_safetensors(prefix: bytes, path: str) -> None:
    """Name a torch.save file as such (only once the header failed to parse: a valid header
    length can begin with the same bytes as a pickle)."""
    start = bytes(prefix[:4])
    if start == b"PK\x03\x04":
        raise ValueError(f"{path} is a torch.save file (a zip archive), not a safetensors "
                         f"checkpoint: load it with torch.load")
    if start[:1] == b"\x80" and start[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise ValueError(f"{path} is a pickle (a legacy torch.save file), not a safetensors "
                         f"checkpoint: load it with torch.load")


def parse_header(prefix: bytes, path: str, file_size: int
                 ) -> Tuple[int, Dict[str, str], List[StoredTensor]]:
    """(header_size, metadata, tensors) from the file's first bytes (at least the header).

    Raises ValueError naming ``path`` and the offset of what is wrong.
    """
    if len(prefix) < PREFIX.size:
        raise ValueError(f"{path}: {file_size} bytes is too short for a checkpoint header")
    (n,) = PREFIX.unpack_from(prefix)
    header_size = PREFIX.size + n
    if header_size > min(len(prefix), file_size):
        _not_safetensors(prefix, path)
        raise ValueError(f"{path} is not a safetensors checkpoint: its header length {n} at "
                         f"offset 0 runs past the end of the file ({file_size} bytes)")
    try:
        header = json.loads(bytes(prefix[PREFIX.size:header_size]))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None) or {}
        checksums = json.loads(metadata.get("flashstream.checksums", "{}"))
        raw = json.loads(metadata.get("flashstream.dtypes", "{}"))
    except (ValueError, UnicodeDecodeError, AttributeError) as err:
        _not_safetensors(prefix, path)
        raise ValueError(f"{path}: the header at offset 8 is not valid JSON ({err})") from None
    version = metadata.get("flashstream.version")
    if version is not None and version != FORMAT_VERSION:
        raise ValueError(f"{path}: written in checkpoint format version {version!r}; this "
                         f"flashstream reads version {FORMAT_VERSION!r} (a newer flashstream "
                         f"wrote it?)")
    tensors = []
    for name, info in header.items():
        try:
            begin, end = (header_size + int(v) for v in info["data_offsets"])
            if name in raw:
                dtype, shape = torch_dtype(raw[name][0]), tuple(int(v) for v in raw[name][1])
            else:
                dtype, shape = torch_dtype(info["dtype"]), tuple(int(v) for v in info["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: bad header entry for tensor {name!r}: {err}") from None
        expected = math.prod(shape) * dtype.itemsize
        if not header_size <= begin <= end <= file_size or end - begin != expected:
            raise ValueError(f"{path}: tensor {name!r} claims bytes [{begin}, {end}) of a "
                             f"{file_size}-byte file for shape {list(shape)} {dtype}")
        crc = checksums.get(name)
        tensors.append(StoredTensor(name, dtype, shape, begin, end,
                                    int(crc, 16) if crc is not None else None))
    return header_size, metadata, tensors
