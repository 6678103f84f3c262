"""Shared by the resume, order and equal-ranks tests: the save/load-state check, data, and
the entry points of real multi-process gloo runs (torch.multiprocessing.spawn imports them).

``check_resume(make_stream, workers=..., stops=...)`` runs one epoch, stops after k samples
for each k in ``stops``, saves the state as plain values (a JSON round trip), resumes in a
fresh stream (and loader) and checks that what came before plus what came after is exactly the
uninterrupted epoch: no repeats, no gaps, same order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from shardgen import make_samples, write_tar

from flashstream import ShardStream

#: Samples per shard: uneven on purpose (a single-sample shard, a large one).
UNEVEN = (7, 3, 12, 1, 9)

MakeStream = Callable[[], ShardStream]


def write_uneven(directory: Path, counts: Sequence[int] = UNEVEN, *, sizes=(100, 3000),
                 gzip: Sequence[int] = ()) -> List[str]:
    """Shards ``s{i}.tar`` (``.tar.gz`` for the indices in ``gzip``) of ``counts[i]`` samples
    with keys ``sh{i}/k{j}``; payload sizes alternate so members straddle 4 KiB chunks."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(counts):
        name = f"s{i}.tar.gz" if i in gzip else f"s{i}.tar"
        samples = make_samples(n, seed=i, prefix=f"sh{i}/k", sizes=sizes)
        paths.append(str(write_tar(directory / name, samples, mode="w:gz" if i in gzip else "w")))
    return paths


def keys(samples) -> List[str]:
    return [s["__key__"] for s in samples]


def _loader(stream: ShardStream, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(stream, batch_size=None, num_workers=workers)


def epoch_keys(make_stream: MakeStream, workers: Optional[int]) -> List[str]:
    """One uninterrupted epoch: the stream itself (``workers=None``) or through a loader."""
    stream = make_stream()
    return keys(stream if workers is None else _loader(stream, workers))


def capture(make_stream: MakeStream, workers: Optional[int], stops: Sequence[int]
            ) -> Dict[int, Tuple[List[str], dict]]:
    """One pass; after k samples for each k in ``stops``: (keys so far, state as plain values)."""
    stream = make_stream()
    source = stream if workers is None else _loader(stream, workers)
    saver = stream.state_dict if workers is None else source.state_dict
    it = iter(source)
    taken: List[str] = []
    out = {}
    for k in sorted(set(stops)):
        while len(taken) < k:
            taken.append(next(it)["__key__"])
        out[k] = (list(taken), json.loads(json.dumps(saver())))
    del it
    return out


def resume_keys(make_stream: MakeStream, state: dict, workers: Optional[int]) -> List[str]:
    """The rest of the epoch from ``state`` in a fresh stream (and loader)."""
    stream = make_stream()
    if workers is None:
        stream.load_state_dict(state)
        return keys(stream)
    loader = _loader(stream, workers)
    loader.load_state_dict(state)
    return keys(loader)


def check_resume(make_stream: MakeStream, *, workers: Optional[int], stops: Sequence[int],
                 reference: Optional[List[str]] = None,
                 resume_workers: Optional[Sequence[Optional[int]]] = None) -> List[str]:
    """Stop after each k in ``stops``, resume, check the concatenation equals the epoch.

    ``resume_workers``: resume each state with these worker counts too, through
    ``ShardStream.collect_states`` and a plain DataLoader (sample plan only)."""
    if reference is None:
        reference = epoch_keys(make_stream, workers)
    assert len(set(reference)) == len(reference), "an uninterrupted epoch repeated a sample"
    for k, (before, state) in capture(make_stream, workers, stops).items():
        after = resume_keys(make_stream, state, workers)
        assert before + after == reference, (k, before, after)
        for other in resume_workers or ():
            stream = make_stream()
            stream.load_state_dict(ShardStream.collect_states(state))
            if other is None:
                after = keys(stream)
            else:
                from torch.utils.data import DataLoader

                after = keys(DataLoader(stream, batch_size=None, num_workers=other))
            assert before + after == reference, (k, other, before, after)
    return reference


def spread(n: int) -> List[int]:
    """A spread of stopping points in an epoch of n samples: the ends and a few between."""
    return sorted(k for k in {0, 1, 2, n // 3, n // 2, n - 2, n - 1, n} if 0 <= k <= n)


# ---- real multi-process runs (torch.multiprocessing.spawn entry points) -------------------

def _init(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def gloo_resume(rank: int, world: int, store: str, paths: List[str], out: str) -> None:
    """Each rank: the resume check on its own share, for both plans; writes its epoch."""
    import torch.distributed as dist

    _init(rank, world, store)
    try:
        result = {}
        for name, kw in (("shards", dict(index=False)), ("samples", dict(index=True)),
                         ("equal", dict(equal_ranks=True))):
            def make(kw=kw):
                return ShardStream(paths, shuffle=4, seed=7, chunk_size="4KiB", **kw)

            # (DataLoader workers inside a gloo rank cost seconds each to start and stop here;
            # gloo_train uses them, the simulated-rank tests resume through them.)
            reference = epoch_keys(make, None)
            check_resume(make, workers=None, stops=spread(len(reference)), reference=reference)
            result[name] = reference
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_train(rank: int, world: int, store: str, paths: List[str], out: str) -> None:
    """A DDP-style loop: an all_reduce per batch, which hangs if one rank runs out early.
    Epoch 0 reads through a DataLoader worker (which cannot see the process group itself),
    epoch 1 in the rank's process."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    _init(rank, world, store)
    try:
        stream = ShardStream(paths, shuffle=5, seed=1, equal_ranks=True)
        seen: List[str] = []
        steps = 0
        for epoch in range(2):
            stream.set_epoch(epoch)
            loader = DataLoader(stream, batch_size=2, num_workers=1 - epoch, collate_fn=keys,
                                multiprocessing_context="fork" if epoch == 0 else None)
            for batch in loader:
                total = torch.tensor([len(batch)])
                dist.all_reduce(total)  # every rank must take part in every step
                steps += 1
                if epoch == 0:
                    seen.extend(batch)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, "keys": seen, "len": len(stream)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
