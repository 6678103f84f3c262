"""Reusing the previous save's layout when the state dict kept its shape.

A training loop saves the same state dict again and again: the same keys, the same tensors'
shapes, dtypes and devices; only values change (and counters such as a scheduler's
``last_epoch``). Planning a layout from scratch costs microseconds per tensor in Python: with
50,000 small tensors about a second of stall, which is most of torch.save's time. ``relayout``
walks the new state beside the previous save's skeleton and, where everything matches,
returns the previous layout with the new tensors as sources and the new plain values in the
skeleton. Anything else (a key added or renamed, a shape or dtype changed, storage no longer
shared as it was, a numpy array, bytes or other types the quick walk leaves to ``flatten``)
returns None, and the caller plans afresh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .format import Layout, Slot

__all__ = ["Plan", "relayout"]

_SCALARS = (str, int, float, bool, type(None))


@dataclasses.dataclass
class Plan:
    """What one save leaves for the next: its skeleton, layout and each name's slot."""

    skeleton: Any
    layout: Layout
    slot_of: Dict[str, int]
    aliased: int = 0  # stored tensors starting where another starts (a view of another dtype)

    @classmethod
    def of(cls, skeleton: Any, layout: Layout) -> Plan:
        return cls(skeleton, layout, {s.name: i for i, s in enumerate(layout.slots)},
                   _aliased([s.source for s in layout.slots]))


def _aliased(sources: List[Optional[torch.Tensor]]) -> int:
    """How many of ``sources`` (with data) start at an address another one starts at."""
    starts = [t.data_ptr() for t in sources if t is not None and t.numel()]
    return len(starts) - len(set(starts))


class _Differs(Exception):
    """The state no longer has the previous save's shape."""


def _refill(value: Any, node: Any, found: List[Tuple[Dict[str, Any], torch.Tensor]]) -> Any:
    """``node`` (a skeleton) with ``value``'s plain values; its tensors appended to ``found``
    beside their references. Raises _Differs where ``value`` does not fit ``node``."""
    if isinstance(node, dict):
        if "T" in node:
            if not isinstance(value, torch.Tensor):
                raise _Differs
            found.append((node, value))
            return node  # the reference (name, device, view) is unchanged
        items = node.get("D")
        if items is not None:
            if not isinstance(value, dict) or len(value) != len(items):
                raise _Differs
            out = []
            for (key, child), (k, v) in zip(items, value.items()):
                if key != k or type(key) is not type(k):  # tuple keys are encoded: slow path
                    raise _Differs
                if type(child) is dict and "T" in child and isinstance(v, torch.Tensor):
                    found.append((child, v))  # a tensor leaf, inline: most of the calls
                    out.append([key, child])
                else:
                    out.append([key, _refill(v, child, found)])
            return {"D": out}
        for tag, kind in (("L", list), ("U", tuple)):
            items = node.get(tag)
            if items is not None:
                if not isinstance(value, kind) or len(value) != len(items):
                    raise _Differs
                return {tag: [_refill(v, child, found) for v, child in zip(value, items)]}
        raise _Differs  # numpy, bytes, sets, ...: flatten encodes those
    if isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        return value
    raise _Differs


def _still_view(t: torch.Tensor, base: torch.Tensor, view: List[Any]) -> bool:
    offset, shape, stride = view
    return (t.dtype is base.dtype and t.device == base.device and list(t.shape) == shape
            and list(t.stride()) == stride
            and t.data_ptr() == base.data_ptr() + offset * t.element_size())


def relayout(state: Any, previous: Plan) -> Optional[Tuple[Any, List[Slot]]]:
    """(skeleton, slots) for ``state`` from ``previous``: the previous save's slots with
    ``state``'s tensors as sources; None when ``state`` does not fit them (plan afresh)."""
    found: List[Tuple[Dict[str, Any], torch.Tensor]] = []
    try:
        skeleton = _refill(state, previous.skeleton, found)
    except _Differs:
        return None
    slots = previous.layout.slots
    sources: List[Optional[torch.Tensor]] = [None] * len(slots)
    views = []
    for ref, t in found:
        i = previous.slot_of.get(ref["T"])
        if i is None:
            return None
        if "v" in ref:
            views.append((ref, t, i))
            continue
        slot = slots[i]
        device = ref.get("d")
        if (sources[i] is not None or t.dtype is not slot.dtype or t.shape != slot.shape
                or not (t.is_cpu if device is None else str(t.device) == device)):
            return None
        sources[i] = t
    if any(s is None for s in sources):
        return None
    # Tensors stored apart that now share memory (weights tied since the plan, or a reserve=
    # dict built with empty_like) must be planned afresh, to be stored once and load tied.
    if _aliased(sources) != previous.aliased:
        return None
    for ref, t, i in views:  # loads rebuild views on a contiguous base
        if not (sources[i].is_contiguous() and _still_view(t, sources[i], ref["v"])):
            return None
    return skeleton, [Slot(s.name, s.dtype, s.shape, s.offset, s.nbytes, src)
                      for s, src in zip(slots, sources)]
