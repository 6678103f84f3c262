"""Loading into an existing state dict (``load_checkpoint(path, into=state)``).

Loading *into* the caller's own tensors puts each value into memory that already exists (the
model's parameters, the optimizer's moments), as ``torch.distributed.checkpoint.load`` does:
the load then needs no memory beyond its read window. Before the read, ``claim_targets``
walks the saved nesting beside ``into`` and picks, per stored tensor, the caller's tensor it
can be read straight into (same key, shape and dtype, contiguous); after it, ``copy_into``
merges the rest (new keys, values of another shape or dtype) with memory of their own.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import numpy as np
import torch

from .format import StoredTensor
from .structure import describe

__all__ = ["claim_targets", "copy_into"]


def claim_targets(into: Any, skeleton: Any, stored: Mapping[str, StoredTensor]
                  ) -> Dict[str, torch.Tensor]:
    """{stored tensor name: the tensor of ``into`` at the same key to read it into}, for the
    references of ``skeleton`` (the saved JSON nesting) whose tensor in ``into`` is contiguous
    with the stored shape and dtype. A view of shared storage (``"v"``) is never claimed: it
    is filled from its base afterwards."""
    claims: Dict[str, torch.Tensor] = {}

    def walk(target: Any, node: Any) -> None:
        if not isinstance(node, dict):
            return
        name = node.get("T")
        if name is not None:
            t = stored.get(name)
            if ("v" not in node and t is not None and name not in claims
                    and isinstance(target, torch.Tensor) and target.is_contiguous()
                    and tuple(target.shape) == t.shape and target.dtype == t.dtype):
                claims[name] = target
            return
        if "D" in node and isinstance(target, dict):
            for key, value in node["D"]:
                if not isinstance(key, dict) and key in target:
                    walk(target[key], value)
        elif "L" in node and isinstance(target, list) and len(target) == len(node["L"]):
            for t, value in zip(target, node["L"]):
                walk(t, value)
        elif "U" in node and isinstance(target, tuple) and len(target) == len(node["U"]):
            for t, value in zip(target, node["U"]):
                walk(t, value)

    walk(into, skeleton)
    return claims


def copy_into(target: Any, loaded: Any, path: Tuple[Any, ...] = (), *, owned: bool = False
              ) -> Any:
    """``loaded`` merged into ``target``: tensors copied into ``target``'s tensors of the same
    shape and dtype (any device), dicts updated key by key, lists updated in place, everything
    else replaced. Returns the merged value (``target`` itself for dicts, lists and tensors).
    ``owned``: ``loaded``'s tensors have memory of their own (else CPU ones are cloned, as
    views of a mapping would keep it alive). Raises ValueError naming the key path where a
    tensor's shape or dtype differs."""
    if isinstance(loaded, np.ndarray) and isinstance(target, np.ndarray) and \
            target.shape == loaded.shape and target.dtype == loaded.dtype and \
            target.flags.writeable:
        np.copyto(target, loaded)
        return target
    if isinstance(loaded, torch.Tensor):
        if loaded is target:  # read straight into it (claim_targets)
            return target
        if isinstance(target, torch.Tensor):
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise ValueError(f"{describe(path, 'state')}: the checkpoint holds {loaded.dtype} "
                                 f"{list(loaded.shape)}, the state to load into has "
                                 f"{target.dtype} {list(target.shape)}")
            with torch.no_grad():
                target.copy_(loaded)
            return target
        return loaded if owned else _owned(loaded)
    if isinstance(loaded, dict) and isinstance(target, dict):
        for key, value in loaded.items():
            target[key] = copy_into(target.get(key), value, path + (key,), owned=owned)
        return target
    if isinstance(loaded, list) and isinstance(target, list) and len(loaded) == len(target):
        for i, value in enumerate(loaded):
            target[i] = copy_into(target[i], value, path + (i,), owned=owned)
        return target
    if isinstance(loaded, tuple) and isinstance(target, tuple) and len(loaded) == len(target):
        return tuple(copy_into(t, v, path + (i,), owned=owned)
                     for i, (t, v) in enumerate(zip(target, loaded)))
    return loaded if owned else _owned_all(loaded)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with memory of its own: every CPU tensor of a load is a view of the read
    buffer (its storage looks like its own, but it holds the buffer), so it is copied; a
    tensor moved to another device already is a copy."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor


def _owned_all(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _owned(value)
    if isinstance(value, np.ndarray):
        return np.array(value, copy=True)
    if isinstance(value, dict):
        return {k: _owned_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_owned_all(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_owned_all(v) for v in value)
    return value

