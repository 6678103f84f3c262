"""load_checkpoint: the newest complete checkpoint (or a given one), read with aligned
requests, verified, and rebuilt into the nested state dict it was saved from."""

from __future__ import annotations

import json
import mmap as _mmap
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import engine, settings
from ..errors import ChecksumError
from ..world import process_group
from .format import StoredTensor, check_header_crc, parse_header
from .inplace import claim_targets, copy_into
from .reading import bytes_of, read_header, read_tensors
from .store import CheckpointInfo, inspect_step, newest_complete
from .structure import saved_devices, unflatten

__all__ = ["load_checkpoint", "resolve_checkpoint"]

PathLike = Union[str, os.PathLike]
MapLocation = Union[None, str, torch.device, Dict[str, Union[str, torch.device]],
                    Callable[[torch.UntypedStorage, str], Optional[torch.UntypedStorage]]]
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.safetensors$")


def _default_rank() -> int:
    group = process_group()
    return group[0] if group is not None else 0


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
    stay); a function ``(storage, location) -> storage or None`` is called as torch.load calls
    it (``storage`` on the CPU, ``location`` the saved device's name; None keeps the default).
    Every tensor has memory of its own: the file streams through a fixed read window
    (checkpoint/reading.py), so nothing but the tensors stays allocated. Tensors bound for a
    CUDA device are read straight into device memory, each chunk's copy through pinned
    buffers overlapping the next reads (checkpoint/device_feed.py). Tensors that shared
    storage when saved (tied weights, views of a base) share it again.
    ``weights_only``: accepted for torch.load's callers; every load is weights-only (the
    format holds no pickled objects). ``mmap=True`` maps the file (through the page cache,
    private copy-on-write pages) and returns views of the mapping instead. ``into``: a state
    dict (the model's, the optimizer's, or a dict of both, as saved) to load *into*: each
    tensor is read straight into the one at the same key when it has the same shape and dtype
    and is contiguous (on any device; ``map_location`` does not move it), the rest is
    replaced or added, and ``into`` is returned (see checkpoint/inplace.py). Each tensor is
    verified as its bytes arrive, so a ChecksumError from a load ``into`` a state leaves that
    state partly overwritten (as a failed in-place load does in torch.distributed.checkpoint).
    ``verify`` checks every tensor's CRC-32C and raises ChecksumError naming the first bad one.
    A plain safetensors file without flashstream metadata loads as a flat {name: tensor} dict.
    """
    _check_map_location(map_location)
    file, marker = resolve_checkpoint(path, rank)
    io = settings.resolve(engine=engine_kind, direct=direct)
    name = str(file)
    if mmap:
        header_size, metadata, tensors, header, values = _mapped(file)
    else:
        header_size, metadata, tensors, header = read_header(file)
    if verify:
        check_header_crc(header, name)
    if verify and marker is not None:
        expected = int(marker["header_crc32c"], 16)
        if engine.crc32c(header) != expected:
            raise ChecksumError(name, "<header>", 0, header_size)
    structure = metadata.get("flashstream.structure")
    skeleton = _skeleton(structure, tensors, name)
    if mmap and verify:  # checked once the header is trusted, and so its offsets
        for t in tensors:
            if t.crc is not None and engine.crc32c(bytes_of(values[t.name]).numpy()) != t.crc:
                raise ChecksumError(name, t.name, t.begin, t.end)
    if not mmap:
        stored = {t.name: t for t in tensors}
        claimed = claim_targets(into, skeleton, stored) if into is not None else {}
        # Tensors bound for a GPU are read straight into device memory (device_feed.py).
        saved_on = saved_devices(skeleton) if torch.cuda.is_available() and not callable(
            map_location) else {}
        values = {t.name: claimed[t.name] if t.name in claimed
                  else torch.empty(t.shape, dtype=t.dtype,
                                   device=_read_into(t.name, saved_on, map_location))
                  for t in tensors}
        read_tensors(file, tensors, values, io, verify=verify)
    else:
        claimed = {}
    placed: Dict[str, Any] = {}

    def resolve(tensor_name: str, ref: Dict[str, Any]) -> Any:
        if tensor_name not in values:
            raise ValueError(f"{name}: the structure refers to a missing tensor {tensor_name!r}")
        if "N" in ref:
            return values[tensor_name].numpy()
        if tensor_name in claimed:
            base = claimed[tensor_name]
        else:
            if tensor_name not in placed:
                placed[tensor_name] = _place(values[tensor_name], ref.get("d"), map_location)
            base = placed[tensor_name]
        if "v" in ref:  # shared storage: a view of the stored base
            offset, shape, stride = ref["v"]
            return base.as_strided(shape, stride, base.storage_offset() + offset)
        return base

    try:
        loaded = unflatten(skeleton, resolve)
    except ValueError as err:
        if name in str(err):
            raise
        raise ValueError(f"{name}: {err}") from None
    finally:
        values.clear()  # nothing but the result may keep a loaded tensor alive
        placed.clear()
    return loaded if into is None else copy_into(into, loaded, owned=not mmap)


def _skeleton(structure: Optional[str], tensors: List[StoredTensor], name: str) -> Any:
    """The saved nesting; a flat {name: ref} for a plain safetensors file."""
    if structure is None:
        return {"D": [[t.name, {"T": t.name}] for t in tensors]}
    try:
        return json.loads(structure)
    except ValueError as err:
        raise ValueError(f"{name}: the structure in the header is not valid JSON ({err})"
                         ) from None


def _mapped(file: Path
            ) -> Tuple[int, Dict[str, str], List[StoredTensor], bytes, Dict[str, torch.Tensor]]:
    """mmap=True: the file mapped (private pages), its tensors views of the mapping."""
    size = os.stat(file).st_size
    if not size:
        raise ValueError(f"{file}: 0 bytes is too short for a checkpoint header")
    with open(file, "rb") as f:
        buffer = _mmap.mmap(f.fileno(), size, flags=_mmap.MAP_PRIVATE,
                            prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
    view = np.frombuffer(buffer, dtype=np.uint8)
    header_size, metadata, tensors = parse_header(view, str(file), size)
    values = {t.name: _tensor(buffer, t) for t in tensors}
    return header_size, metadata, tensors, bytes(view[:header_size]), values


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
        return
    raise ValueError(f"map_location must be None, a str, a torch.device, a dict or a function "
                     f"(storage, location), got {type(map_location).__name__}")


def _tensor(buffer: _mmap.mmap, t: StoredTensor) -> torch.Tensor:
    if t.end == t.begin:
        return torch.empty(t.shape, dtype=t.dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=t.end - t.begin, offset=t.begin)
    return flat.view(t.dtype).view(t.shape)


def _target(saved_on: Optional[str], map_location: MapLocation) -> Any:
    """Where a tensor saved on ``saved_on`` goes (a non-callable ``map_location``)."""
    if isinstance(map_location, dict):
        return map_location.get(saved_on or "cpu", saved_on)
    return map_location if map_location is not None else saved_on


def _read_into(name: str, saved_on: Dict[str, Optional[str]], map_location: MapLocation
               ) -> Optional[torch.device]:
    """The CUDA device to read tensor ``name`` straight into, else None (read to the CPU;
    ``_place`` then moves it, or says why it cannot). ``saved_on``: empty without CUDA."""
    if name not in saved_on:
        return None
    target = _target(saved_on[name], map_location)
    device = torch.device(target) if target is not None else None
    return device if device is not None and device.type == "cuda" else None


def _place(value: torch.Tensor, saved_on: Optional[str], map_location: MapLocation
           ) -> torch.Tensor:
    if callable(map_location):
        return _call_map_location(value, saved_on, map_location)
    target = _target(saved_on, map_location)
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


def _call_map_location(value: torch.Tensor, saved_on: Optional[str],
                       function: Callable[..., Any]) -> torch.Tensor:
    """torch.load's protocol: ``function(storage, location)`` returns the storage to use, or
    None for the default (back where it was saved)."""
    location = saved_on or "cpu"
    storage = function(value.untyped_storage(), location)
    if storage is None:
        return _place(value, saved_on, None)
    if isinstance(storage, torch.TypedStorage):
        storage = storage.untyped()
    if not isinstance(storage, torch.UntypedStorage):
        raise TypeError(f"map_location returned a {type(storage).__name__} for a storage on "
                        f"{location}; it must return a torch storage or None")
    if storage.nbytes() < value.untyped_storage().nbytes():
        raise ValueError(f"map_location returned a storage of {storage.nbytes()} bytes for one "
                         f"of {value.untyped_storage().nbytes()}")
    out = torch.empty(0, dtype=value.dtype, device=storage.device)
    return out.set_(storage, value.storage_offset(), value.shape, value.stride())
