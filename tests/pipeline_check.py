"""Shared by the pipeline tests: items as comparable values, and the resume check for any
pipeline through torchdata's StatefulDataLoader.

``check_resume(make, workers=..., stops=...)`` runs one epoch, stops after k items for each k
in ``stops``, saves the loader's state as plain values (a JSON round trip), resumes in a fresh
pipeline and loader, and checks that the items before plus the items after are exactly the
uninterrupted epoch.
"""

from __future__ import annotations

import json
from typing import Any, Callable, List, Optional, Sequence

from flashstream.batches import Ragged

MakePipeline = Callable[[], Any]


def flat(item: Any) -> Any:
    """A hashable, comparable form of an item: samples by key, batches as tuples, tensors and
    arrays by value."""
    if isinstance(item, dict):
        if "__key__" in item:
            keys = item["__key__"]
            return tuple(keys) if isinstance(keys, (list, tuple)) else keys
        return tuple(sorted((k, flat(v)) for k, v in item.items()))
    if isinstance(item, Ragged):
        return tuple(bytes(x.numpy()) for x in item.split())
    if isinstance(item, (list, tuple)):
        return tuple(flat(v) for v in item)
    if hasattr(item, "tolist"):
        return flat(item.tolist())
    return item


def loader(dataset: Any, workers: int, **kw: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, **kw)


def epoch_items(make: MakePipeline, workers: Optional[int]) -> List[Any]:
    """One uninterrupted epoch: the pipeline itself (``workers=None``) or through a loader."""
    dataset = make()
    source = dataset if workers is None else loader(dataset, workers)
    return [flat(item) for item in source]


def check_resume(make: MakePipeline, *, workers: int, stops: Optional[Sequence[int]] = None,
                 reference: Optional[List[Any]] = None) -> List[Any]:
    """Stop after each k in ``stops`` (default: every k), resume, compare with the epoch."""
    if reference is None:
        reference = epoch_items(make, workers)
    for k in sorted(set(range(len(reference) + 1) if stops is None else stops)):
        first = loader(make(), workers)
        it = iter(first)
        before = [flat(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        del it, first
        second = loader(make(), workers)
        second.load_state_dict(state)
        after = [flat(item) for item in second]
        assert before + after == reference, (k, before, after, reference)
    return reference
