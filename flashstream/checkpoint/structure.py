"""Turning a nested state dict into tensors plus a JSON skeleton, and back.

A training state dict mixes tensors with plain values in nested dicts, lists and tuples (a
model's and an optimizer's state dicts, a scheduler's counters, RNG states, a stream's
position). Tensors go into the safetensors data region; everything else, and the shape of the
nesting, goes into one JSON "skeleton" kept in the header metadata, where each tensor appears
as a reference to its name. Dict keys keep their types (an optimizer's state is keyed by int).

Encoding of a value (JSON):
    None, bool, int, float, str   as themselves (floats keep nan/inf)
    {"T": name}                   a torch.Tensor (``"d"``: its device when not the CPU;
                                  ``"v": [offset, shape, stride]``: a view of tensor ``name``'s
                                  storage, for tensors that shared storage when saved)
    {"N": name}                   a numpy.ndarray (restored as one)
    {"D": [[key, value], ...]}    a dict (keys encoded the same way)
    {"L": [...]} / {"U": [...]}   a list / a tuple
    {"B": base64}                 bytes
    {"C": [real, imag]}           a complex
    {"S": [...]} / {"F": [...]}   a set / a frozenset
    {"Y": "float32"}              a torch.dtype
    {"V": "cuda:0"}               a torch.device
    {"P": [dtype, value]}         a numpy scalar (np.float32(0.5), np.int64(3), ...)
"""

from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["TensorEntry", "describe", "flatten", "saved_devices", "unflatten", "SUPPORTED_TYPES"]

SUPPORTED_TYPES = ("torch.Tensor", "numpy.ndarray", "dict", "list", "tuple", "set", "frozenset",
                   "str", "int", "float", "complex", "bool", "None", "bytes", "numpy scalars",
                   "torch.dtype", "torch.device")
_SCALARS = (str, int, float, bool, type(None))


@dataclasses.dataclass
class TensorEntry:
    """One tensor of the state dict: where it is in the nesting and what it holds."""

    name: str  # unique; the path of keys joined by "/"
    tensor: torch.Tensor
    path: Tuple[Any, ...]  # the keys leading to it
    numpy: bool = False  # came from a numpy array

    @property
    def key_path(self) -> str:
        """For error messages, e.g. "state_dict['optimizer']['state'][0]['exp_avg']"."""
        return describe(self.path)


def describe(path: Tuple[Any, ...], root: str = "state_dict") -> str:
    """A key path as Python would index it, e.g. "state_dict['optimizer']['state'][0]"."""
    return root + "".join(f"[{k!r}]" for k in path)


def _unsupported(value: Any, path: Tuple[Any, ...], why: str = "") -> TypeError:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return TypeError(f"{describe(path)}: cannot checkpoint a {kind}{why}; supported types: "
                     f"{', '.join(SUPPORTED_TYPES)}")


def _check_tensor(t: torch.Tensor, path: Tuple[Any, ...]) -> None:
    if not (t.layout is not torch.strided or t.is_quantized or t.is_meta or t.is_nested):
        return  # the usual case, in one test: this runs for every tensor of every save
    if t.layout != torch.strided:
        raise _unsupported(t, path, f" with layout {t.layout} (only dense tensors)")
    if t.is_quantized:
        raise _unsupported(t, path, " that is quantized")
    if t.device.type == "meta":
        raise _unsupported(t, path, " on the meta device (it has no data)")
    if getattr(t, "is_nested", False):
        raise _unsupported(t, path, " that is nested")


def _encode_key(key: Any, path: Tuple[Any, ...]) -> Any:
    if isinstance(key, _SCALARS) and not (isinstance(key, float) and math.isnan(key)):
        return key
    if isinstance(key, tuple):
        return {"U": [_encode_key(k, path) for k in key]}
    raise TypeError(f"{describe(path)}: cannot checkpoint a dict key of type "
                    f"{type(key).__qualname__} ({key!r}); keys may be str, int, float, bool, "
                    f"None or tuples of those")


def flatten(state: Any) -> Tuple[Any, List[TensorEntry]]:
    """(skeleton, tensors) for ``state``; raises TypeError naming the key of anything else.

    Nothing is copied: the entries hold the caller's tensors (numpy arrays as CPU tensors).
    """
    entries: List[TensorEntry] = []
    # safetensors' header keeps its metadata under this key: a tensor there would replace it.
    used: set = {"__metadata__"}
    active: set = set()  # ids of the containers being walked (a cycle would recurse forever)

    def name_for(path: Tuple[Any, ...]) -> str:
        base = "/".join(map(str, path)) or "tensor"
        name, n = base, 0
        while name in used:  # "a/b" from {"a/b": x} and from {"a": {"b": y}}
            n += 1
            name = f"{base}~{n}"
        used.add(name)
        return name

    refs: List[Dict[str, Any]] = []  # beside entries, for the torch tensors' references

    def walk(value: Any, path: Tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            _check_tensor(value, path)
            name = name_for(path)
            entries.append(TensorEntry(name, value, path))
            ref: Dict[str, Any] = {"T": name}
            if value.device.type != "cpu":
                ref["d"] = str(value.device)
            refs.append(ref)
            return ref
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject or value.dtype.kind not in "biufc":
                raise _unsupported(value, path, f" of dtype {value.dtype} (numeric arrays only)")
            name = name_for(path)
            array = np.ascontiguousarray(value)
            entries.append(TensorEntry(name, torch.from_numpy(array), path, True))
            return {"N": name}
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            item = value.item()  # np.float64 and np.complex128 are float and complex too
            if not isinstance(item, (bool, int, float, complex)):  # np.longdouble stays numpy
                raise _unsupported(value, path, f" of dtype {value.dtype} (no Python "
                                                f"equivalent)")
            return {"P": [value.dtype.str, walk(item, path)]}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, (bytes, bytearray)):
            return {"B": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, complex):
            return {"C": [value.real, value.imag]}
        if isinstance(value, torch.dtype):
            return {"Y": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"V": str(value)}
        if isinstance(value, np.generic) and not isinstance(value, _SCALARS):
            raise _unsupported(value, path, f" of dtype {value.dtype} (numeric only)")
        if isinstance(value, (set, frozenset)):  # hashable members only: never a cycle
            items = [walk(v, path + (i,)) for i, v in enumerate(value)]
            return {"S": items} if isinstance(value, set) else {"F": items}
        if isinstance(value, (dict, list, tuple)):
            if id(value) in active:
                raise TypeError(f"{describe(path)}: the state dict contains itself (a cycle)")
            active.add(id(value))
            try:
                if isinstance(value, dict):
                    return {"D": [[_encode_key(k, path), walk(v, path + (k,))]
                                  for k, v in value.items()]}
                items = [walk(v, path + (i,)) for i, v in enumerate(value)]
                return {"L": items} if isinstance(value, list) else {"U": items}
            finally:
                active.discard(id(value))
        raise _unsupported(value, path)

    skeleton = walk(state, ())
    return skeleton, _share_storage(entries, refs)


def _share_storage(entries: List[TensorEntry], refs: List[Dict[str, Any]]
                   ) -> List[TensorEntry]:
    """Store shared storage once, as torch.save does: where tensors share one storage (tied
    embedding and output weights, a view and its base) and one of them, contiguous, covers
    the others' elements, only that base is stored; the others' references become views of it
    (``"v"``), so they load sharing storage again. Tensors of another dtype than the base, or
    that no single contiguous tensor covers, are stored on their own. Returns the entries to
    store (``refs`` are changed in place)."""
    tensor_entries = [e for e in entries if not e.numpy]
    groups: Dict[int, List[int]] = {}
    for i, e in enumerate(tensor_entries):
        t = e.tensor
        # The storage's address without building a storage object (which costs microseconds
        # each, seconds over a large state dict). Devices are compared below, within a group.
        key = t.data_ptr() - t.storage_offset() * t.element_size()
        if key:
            groups.setdefault(key, []).append(i)
    dropped: set = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        bases = [i for i in members if tensor_entries[i].tensor.is_contiguous()]
        if not bases:
            continue
        b = max(bases, key=lambda i: tensor_entries[i].tensor.numel())
        base = tensor_entries[b].tensor
        lo, hi = base.storage_offset(), base.storage_offset() + base.numel()
        for i in members:
            t = tensor_entries[i].tensor
            if (i == b or t.dtype != base.dtype or t.device != base.device or not t.numel()
                    or any(st < 0 for st in t.stride())):
                continue
            first = t.storage_offset()
            last = first + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            if lo <= first and last < hi:
                refs[i]["T"] = tensor_entries[b].name
                refs[i]["v"] = [first - lo, list(t.shape), list(t.stride())]
                dropped.add(id(tensor_entries[i]))
    return [e for e in entries if id(e) not in dropped] if dropped else entries


def _decode_key(key: Any) -> Any:
    if isinstance(key, dict):
        return tuple(_decode_key(k) for k in key["U"])
    return key


def saved_devices(skeleton: Any) -> Dict[str, Optional[str]]:
    """{tensor name: the device it was saved from (None: the CPU)} for every tensor reference
    (``"T"``) in the skeleton; the first reference of a name decides, as in a load."""
    found: Dict[str, Optional[str]] = {}
    todo = [skeleton]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if "T" in node:
                found.setdefault(node["T"], node.get("d"))
            else:
                todo.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            todo.extend(reversed(node))
    return found


def unflatten(skeleton: Any, tensor: Callable[[str, Dict[str, Any]], Any]) -> Any:
    """Rebuild the nesting; ``tensor(name, ref)`` returns the value of each tensor reference."""
    # A module-level recursion, not a nested function: a nested one refers to itself through
    # its closure, a cycle that would keep ``tensor`` and all it refers to (a load's tensors)
    # alive until the cyclic GC happens to run.
    return _build(skeleton, tensor)


def _build(node: Any, tensor: Callable[[str, Dict[str, Any]], Any]) -> Any:
    if not isinstance(node, dict):
        return node
    if "T" in node or "N" in node:
        return tensor(node.get("T", node.get("N")), node)
    if "D" in node:
        return {_decode_key(k): _build(v, tensor) for k, v in node["D"]}
    if "L" in node:
        return [_build(v, tensor) for v in node["L"]]
    if "U" in node:
        return tuple(_build(v, tensor) for v in node["U"])
    if "B" in node:
        return base64.b64decode(node["B"])
    if "C" in node:
        return complex(*node["C"])
    if "S" in node:
        return {_build(v, tensor) for v in node["S"]}
    if "F" in node:
        return frozenset(_build(v, tensor) for v in node["F"])
    if "Y" in node:
        dtype = getattr(torch, node["Y"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {node['Y']!r} in the checkpoint's structure")
        return dtype
    if "V" in node:
        return torch.device(node["V"])
    if "P" in node:
        dtype, item = node["P"]
        return np.dtype(dtype).type(_build(item, tensor))
    raise ValueError(f"unknown node in the checkpoint's structure: {sorted(node)}")
