"""Loading into an existing state dict (``load_checkpoint(path, into=state)``).

A plain load returns CPU tensors that are views of one read buffer: cheap, but an optimizer
that keeps a few of them keeps the whole buffer alive (reported: a 768 MiB model + AdamW
checkpoint left RSS 260 MiB above torch.load's for the rest of training). Loading *into* the
caller's own tensors copies each value into memory that already exists (the model's
parameters, the optimizer's moments), as ``torch.distributed.checkpoint.load`` does, and gives
anything new its own storage, so nothing refers to the read buffer afterwards and it is freed
when the load returns.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np
import torch

__all__ = ["copy_into"]


def copy_into(target: Any, loaded: Any, path: Tuple[Any, ...] = ()) -> Any:
    """``loaded`` merged into ``target``: tensors copied into ``target``'s tensors of the same
    shape and dtype (any device), dicts updated key by key, lists updated in place, everything
    else replaced. Returns the merged value (``target`` itself for dicts, lists and tensors).
    Raises ValueError naming the key path where a tensor's shape or dtype differs."""
    if isinstance(loaded, np.ndarray) and isinstance(target, np.ndarray) and \
            target.shape == loaded.shape and target.dtype == loaded.dtype and \
            target.flags.writeable:
        np.copyto(target, loaded)
        return target
    if isinstance(loaded, torch.Tensor):
        if isinstance(target, torch.Tensor):
            if target.shape != loaded.shape or target.dtype != loaded.dtype:
                raise ValueError(f"{_describe(path)}: the checkpoint holds {loaded.dtype} "
                                 f"{list(loaded.shape)}, the state to load into has "
                                 f"{target.dtype} {list(target.shape)}")
            with torch.no_grad():
                target.copy_(loaded)
            return target
        return _owned(loaded)
    if isinstance(loaded, dict) and isinstance(target, dict):
        for key, value in loaded.items():
            target[key] = copy_into(target.get(key), value, path + (key,))
        return target
    if isinstance(loaded, list) and isinstance(target, list) and len(loaded) == len(target):
        for i, value in enumerate(loaded):
            target[i] = copy_into(target[i], value, path + (i,))
        return target
    if isinstance(loaded, tuple) and isinstance(target, tuple) and len(loaded) == len(target):
        return tuple(copy_into(t, v, path + (i,)) for i, (t, v) in enumerate(zip(target, loaded)))
    return _owned_all(loaded)


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


def _describe(path: Tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)
