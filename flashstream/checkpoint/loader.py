"""load_checkpoint: the newest complete checkpoint (or a given one), read with aligned
requests, verified, and rebuilt into the nested state dict it was saved from."""

from __future__ import annotations

import json
import mmap as _mmap
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch

from .. import engine, settings
from ..errors import ChecksumError
from .format import StoredTensor, check_header_crc, parse_header
from .inplace import copy_into
from .store import CheckpointInfo, inspect_step, newest_complete
from .structure import unflatten

__all__ = ["load_checkpoint", "resolve_checkpoint"]

PathLike = Union[str, os.PathLike]
MapLocation = Union[None, str, torch.device, Dict[str, Union[str, torch.device]]]
_READ_CHUNK = 8 << 20
_READ_DEPTH = 8
_CAPACITY_ALIGN = 1 << 16  # room for the last O_DIRECT request to run past the end
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.safetensors$")


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def resolve_checkpoint(path: PathLike, rank: Optional[int] = None
                       ) -> Tuple[Path, Optional[Dict[str, Any]]]:
    """(file to read, its commit marker or None) for a checkpoint directory, one step's
    directory, or a file. Raises FileNotFoundError when there is no complete checkpoint."""
    p = Path(path)
    rank = _default_rank() if rank is None else rank
    if p.is_file():
        match = _RANK_FILE.match(p.name)
        marker = p.with_suffix(".done")
        return p, (json.loads(marker.read_text()) if match and marker.exists() else None)
    if not p.is_dir():
        raise FileNotFoundError(f"no checkpoint at {p}")
    info: Optional[CheckpointInfo] = inspect_step(p)
    if info is None:
        info = newest_complete(p)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint in {p}")
    elif not info.complete:
        raise FileNotFoundError(f"checkpoint {p} is incomplete: ranks {info.missing_ranks} "
                                f"never committed")
    if not 0 <= rank < info.world_size:
        raise ValueError(f"rank {rank} is not in checkpoint {info.path} "
                         f"(written by {info.world_size} ranks)")
    return info.rank_file(rank), info.marker(rank)


def load_checkpoint(path: PathLike, *, map_location: MapLocation = None,
                    rank: Optional[int] = None, verify: bool = True,
                    engine_kind: Optional[str] = None, direct: Optional[bool] = None,
                    weights_only: Optional[bool] = None, mmap: bool = False,
                    into: Any = None) -> Any:
    """Load a checkpoint written by CheckpointWriter (or any safetensors file).

    ``path``: the writer's directory (the newest complete checkpoint is loaded), one step's
    directory, or a file. ``rank``: which rank's file (default: this process's
    torch.distributed rank, else 0). ``map_location``: None puts tensors back on the device
    they were saved from; "cpu", "cuda:0", a torch.device move them there; a dict maps the
    saved device ("cpu", "cuda:1") to a target, as torch.load's does (devices it does not name
    stay). CPU tensors are zero-copy views of one read buffer, which stays alive while any of
    them does. ``weights_only``: accepted for torch.load's callers; every load is weights-only
    (the format holds no pickled objects). ``mmap=True`` maps the file (through the page cache,
    private copy-on-write pages) instead of reading it into memory with O_DIRECT. ``into``: a
    state dict (the model's, the optimizer's, or a dict of both, as saved) to load *into*:
    each tensor is copied into the one at the same key (same shape and dtype, any device),
    the rest is replaced or added with memory of its own, and ``into`` is returned; nothing
    keeps the read buffer alive afterwards (see checkpoint/inplace.py).
    ``verify`` checks every tensor's CRC-32C and raises ChecksumError naming the first bad one.
    A plain safetensors file without flashstream metadata loads as a flat {name: tensor} dict.
    """
    _check_map_location(map_location)
    file, marker = resolve_checkpoint(path, rank)
    io = settings.resolve(engine=engine_kind, direct=direct)
    size = os.stat(file).st_size
    if mmap and size:
        with open(file, "rb") as f:
            buffer = _mmap.mmap(f.fileno(), size, flags=_mmap.MAP_PRIVATE,
                                prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
        view = np.frombuffer(buffer, dtype=np.uint8)
    else:
        buffer = _mmap.mmap(-1, max(_CAPACITY_ALIGN,
                                    -(-size // _CAPACITY_ALIGN) * _CAPACITY_ALIGN),
                            flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
        view = np.frombuffer(buffer, dtype=np.uint8)
        engine.read_into(file, view, size, engine=io.engine, chunk_size=_READ_CHUNK,
                         queue_depth=_READ_DEPTH, direct=io.direct)
    name = str(file)
    header_size, metadata, tensors = parse_header(view[:min(size, len(view))], name, size)
    if verify:
        check_header_crc(bytes(view[:header_size]), name)
    if verify and marker is not None:
        expected = int(marker["header_crc32c"], 16)
        if engine.crc32c(view[:header_size]) != expected:
            raise ChecksumError(name, "<header>", 0, header_size)
    if verify:
        for t in tensors:
            if t.crc is not None and engine.crc32c(view[t.begin:t.end]) != t.crc:
                raise ChecksumError(name, t.name, t.begin, t.end)
    values = {t.name: _tensor(buffer, t) for t in tensors}
    structure = metadata.get("flashstream.structure")
    if structure is None:
        flat = {n: _place(v, None, map_location) for n, v in values.items()}
        return flat if into is None else copy_into(into, flat)

    def resolve(tensor_name: str, ref: Dict[str, Any]) -> Any:
        if tensor_name not in values:
            raise ValueError(f"{name}: the structure refers to a missing tensor {tensor_name!r}")
        value = values[tensor_name]
        if "N" in ref:
            return value.numpy()
        return _place(value, ref.get("d"), map_location)

    try:
        loaded = unflatten(json.loads(structure), resolve)
    except ValueError as err:
        if name in str(err):
            raise
        raise ValueError(f"{name}: {err}") from None
    return loaded if into is None else copy_into(into, loaded)


def _check_map_location(map_location: Any) -> None:
    if map_location is None or isinstance(map_location, (str, torch.device)):
        return
    if isinstance(map_location, dict):
        for saved, target in map_location.items():
            if not isinstance(saved, str) or not isinstance(target, (str, torch.device)):
                raise ValueError(f"map_location as a dict maps saved device names (str) to "
                                 f"devices (str or torch.device), got {saved!r}: {target!r}")
        return
    if callable(map_location):
        raise ValueError("map_location as a function (storage, location) is torch.load's; "
                         "here pass a str, a torch.device, or a dict {saved device: target}")
    raise ValueError(f"map_location must be None, a str, a torch.device or a dict, got "
                     f"{type(map_location).__name__}")


def _tensor(buffer: _mmap.mmap, t: StoredTensor) -> torch.Tensor:
    if t.end == t.begin:
        return torch.empty(t.shape, dtype=t.dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=t.end - t.begin, offset=t.begin)
    return flat.view(t.dtype).view(t.shape)


def _place(value: torch.Tensor, saved_on: Optional[str], map_location: MapLocation
           ) -> torch.Tensor:
    if isinstance(map_location, dict):
        target = map_location.get(saved_on or "cpu", saved_on)
    else:
        target = map_location if map_location is not None else saved_on
    if target is None:
        return value
    device = torch.device(target)
    if device.type == "cuda" and not torch.cuda.is_available():
        if target == saved_on:
            raise RuntimeError(f"the checkpoint holds a tensor saved on {device}, and CUDA is "
                               f"not available here; pass map_location='cpu'")
        raise RuntimeError(f"map_location {str(device)!r} needs CUDA, which is not available "
                           f"here")
    return value if device.type == "cpu" else value.to(device)
