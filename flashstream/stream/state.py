"""The resume state of a ShardStream: plain values (str, int, bool, None, lists, str-keyed
dicts) that fit a checkpoint's JSON skeleton, torchdata's StatefulDataLoader, or ``json.dump``.

Layout (see docs/shardstream.md, "Exact resume")::

    {"format": "flashstream.ShardStream", "version": 1, "plan": "shards" | "samples",
     "epoch": 3, "config": {...}, "shards": {"count": 12, "digest": "..."},
     "world_size": 4, "rank": 1, "num_workers": 2, "batch_size": 1,
     "workers": {"0": {...}, "1": {...}},        # one entry per DataLoader worker
     "done_below": 0, "done_extra": []}          # sample plan: positions delivered before

``num_workers == 0`` and no entries: nothing of the epoch was delivered yet. Shard-plan entry:
``{"position": i, "shard": s, "offset": o, "buffer": [s, o, e, ...], "draws": d, "finished":
b}`` (the worker's next shard in its list, the byte offset of the next sample header to read
there, the buffered samples by reference, the buffer's draw count, whether it delivered all of
its share). Sample-plan entry: ``{"cursor": p, "finished": b}`` (the worker delivered all its
positions below ``p``).

A DataLoader worker's own state has its entry only; ``merge_states`` (``collect_states``)
joins the entries of all workers.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from .plan import positions

__all__ = ["FORMAT", "Delivered", "Identity", "check_state", "delivered", "find_states",
           "finished", "merge_states", "nested_dicts", "new_state", "own_entry", "shard_digest",
           "shard_entry", "worker_cursor"]

FORMAT = "flashstream.ShardStream"
VERSION = 1


def shard_digest(urls: Sequence[str], counts: Optional[Sequence[int]]) -> str:
    """Fingerprint of the shard list (and, for the sample plan, of every shard's count)."""
    h = hashlib.sha256("\n".join(urls).encode("utf-8", "surrogateescape"))
    if counts is not None:
        h.update((":" + ",".join(map(str, counts))).encode())
    return h.hexdigest()[:20]


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a state must match to be loaded into a stream."""

    plan: str
    config: Dict[str, Any]
    shards: Dict[str, Any]
    world_size: int
    rank: int


def new_state(identity: Identity, epoch: int, *, num_workers: int = 0, batch_size: int = 1,
              workers: Optional[Dict[str, dict]] = None,
              done: Tuple[int, Sequence[int]] = (0, ())) -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "plan": identity.plan, "epoch": epoch,
        "config": dict(identity.config), "shards": dict(identity.shards),
        "world_size": identity.world_size, "rank": identity.rank,
        "num_workers": num_workers, "batch_size": batch_size, "workers": dict(workers or {}),
    }
    if identity.plan == "samples":
        state["done_below"], state["done_extra"] = done[0], list(done[1])
    return state


def _is_state(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def check_state(state: Any, identity: Identity) -> None:
    """Raise ``ValueError`` saying what differs when ``state`` cannot resume this stream."""
    if not _is_state(state):
        raise ValueError("not a ShardStream state: expected a dict made by ShardStream."
                         "state_dict() (use ShardStream.collect_states() to pull the states "
                         "out of a DataLoader's state)")
    if state.get("version") != VERSION:
        raise ValueError(f"ShardStream state version {state.get('version')!r} is not "
                         f"supported (this flashstream reads version {VERSION})")
    if state["plan"] != identity.plan:
        names = {"shards": "shard plan (no index)", "samples": "sample plan (with an index)"}
        raise ValueError(f"the state was saved by a stream using the {names[state['plan']]}, "
                         f"this one uses the {names[identity.plan]}; resume with the same "
                         f"index= setting and the same sidecar files")
    if state["shards"] != identity.shards:
        raise ValueError(f"the state was saved for a different shard list "
                         f"({state['shards']['count']} shards, digest "
                         f"{state['shards']['digest']}; now {identity.shards['count']} shards, "
                         f"digest {identity.shards['digest']}): same urls in the same order, "
                         f"and for the sample plan the same per-shard sample counts, are needed")
    saved, now = state["config"].get("pipeline", ""), identity.config.get("pipeline", "")
    if saved != now:
        raise ValueError(f"the state was saved by a pipeline with stages {saved or '(none)'!r}, "
                         f"this one has {now or '(none)'!r}: the same stages and batch sizes "
                         f"are needed to resume")
    diffs = [f"{key}={state['config'].get(key)!r} (now {value!r})"
             for key, value in identity.config.items() if state["config"].get(key) != value]
    if diffs:
        raise ValueError("the state was saved with different stream settings: "
                         + ", ".join(diffs))
    if (state["world_size"], state["rank"]) != (identity.world_size, identity.rank):
        raise ValueError(f"the state was saved by rank {state['rank']} of "
                         f"{state['world_size']}, this is rank {identity.rank} of "
                         f"{identity.world_size}: each rank must load its own state, and "
                         f"resuming mid-epoch with a different number of ranks is not "
                         f"supported (start the next epoch instead)")


def finished(state: Dict[str, Any]) -> bool:
    """True when every worker entry in ``state`` delivered all of its share of the epoch."""
    entries = state["workers"].values()
    return bool(entries) and all(entry.get("finished") for entry in entries)


def nested_dicts(obj: Any) -> Iterator[Dict[str, Any]]:
    """Every dict inside ``obj`` (``obj`` itself included), through dicts, lists and tuples."""
    if isinstance(obj, dict):
        yield obj
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return
    for value in values:
        yield from nested_dicts(value)


def find_states(obj: Any) -> List[Dict[str, Any]]:
    """Every ShardStream state nested anywhere in ``obj`` (e.g. a StatefulDataLoader's state)."""
    return [found for found in nested_dicts(obj) if _is_state(found)]


_SHARED = ("version", "plan", "epoch", "config", "shards", "world_size", "rank", "num_workers",
           "batch_size", "done_below", "done_extra")


def merge_states(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One state holding the worker entries of ``states`` (the per-worker states a DataLoader
    collects), which must come from the same pass."""
    if not states:
        raise ValueError("no ShardStream state found to merge")
    fresh = [s for s in states if s["num_workers"] == 0]
    started = [s for s in states if s["num_workers"] != 0] or fresh[:1]
    merged = copy.deepcopy(started[0])
    for state in started[1:]:
        for key in _SHARED:
            if state.get(key) != merged.get(key):
                raise ValueError(f"cannot merge ShardStream states of different passes: "
                                 f"{key} is {merged.get(key)!r} in one, {state.get(key)!r} in "
                                 f"another")
        merged["workers"].update(copy.deepcopy(state["workers"]))
    return merged


@dataclasses.dataclass(frozen=True)
class Delivered:
    """Sample plan: positions of the rank's sequence delivered before this pass."""

    below: int = 0
    extra: FrozenSet[int] = frozenset()

    def __contains__(self, p: int) -> bool:
        return p < self.below or p in self.extra


def delivered(state: Dict[str, Any], length: int) -> Delivered:
    """Everything a complete sample-plan state says was delivered, in a form that does not
    depend on how many workers delivered it (so any number of workers can resume it)."""
    before = Delivered(state["done_below"], frozenset(state["done_extra"]))
    workers, block = state["num_workers"], state["batch_size"]
    if workers == 0:
        return before
    missing = [w for w in range(workers) if str(w) not in state["workers"]]
    if missing:
        raise ValueError(f"the state holds {len(state['workers'])} of the {workers} DataLoader "
                         f"workers' positions (missing worker {missing[0]}): resuming with "
                         f"another worker count needs them all (pass the DataLoader's whole "
                         f"state through ShardStream.collect_states)")
    cursors = {w: int(state["workers"][str(w)]["cursor"]) for w in range(workers)}
    # A worker has delivered everything of its own up to its first undelivered position.
    firsts = []
    layout = dict(base=before.below, skip=before.extra)  # how the pass dealt positions
    for w, cursor in cursors.items():
        firsts.append(next(positions(length, w, workers, block, start=cursor, **layout), length))
    below = min(firsts, default=length)
    extra = {p for p in before.extra if p >= below}
    for w, cursor in cursors.items():
        extra.update(positions(min(cursor, length), w, workers, block, start=below, **layout))
    return Delivered(below, frozenset(extra))


def own_entry(state: Dict[str, Any], worker: int, workers: int, block: int
              ) -> Optional[Dict[str, Any]]:
    """``worker``'s entry when ``state`` is that worker's own (one entry, saved with this many
    workers and this block size, as StatefulDataLoader hands it back): it continues from
    there. None for any other state (merged from several workers)."""
    entry = state["workers"].get(str(worker))
    same_layout = (state["num_workers"], state["batch_size"]) == (workers, block)
    return entry if same_layout and len(state["workers"]) == 1 else None


def worker_cursor(state: Dict[str, Any], worker: int, workers: int, block: int,
                  length: int) -> Tuple[Delivered, int]:
    """Sample plan: (positions delivered before, first position to consider) for ``worker``.

    A worker's own state (one entry, as StatefulDataLoader hands it back to the same worker,
    which also resumes its round-robin at the right worker) continues from its cursor. Any
    other state (merged from several workers) is turned into the set of positions delivered,
    and the rest is dealt again from worker 0, as a fresh DataLoader reads them."""
    entry = own_entry(state, worker, workers, block)
    if entry is not None:
        return Delivered(state["done_below"], frozenset(state["done_extra"])), int(entry["cursor"])
    done = delivered(state, length)
    return done, done.below


def shard_entry(state: Dict[str, Any], worker: int, workers: int) -> Optional[Dict[str, Any]]:
    """Shard plan: the worker's entry, None for a fresh epoch. The shard plan gives each worker
    its own shards and buffer, so the worker count must be the one the state was saved with."""
    if state["num_workers"] == 0:
        return None
    if state["num_workers"] != workers:
        raise ValueError(f"the state was saved with {state['num_workers']} DataLoader "
                         f"worker(s), this pass has {workers}: without an index each worker "
                         f"reads its own shards, so resume with num_workers="
                         f"{state['num_workers'] if state['num_workers'] > 1 else '0 or 1'} "
                         f"(or index the shards with `flashstream index` to change it)")
    if workers > 1 and len(state["workers"]) > 1:
        raise ValueError(f"a state merged from {len(state['workers'])} DataLoader workers "
                         f"cannot resume the shard plan in order: a new DataLoader starts its "
                         f"round-robin at worker 0, not where the saved one stopped. Resume "
                         f"through StatefulDataLoader.load_state_dict (same num_workers), with "
                         f"num_workers=0 or 1, or use the default index (sample plan)")
    entry = state["workers"].get(str(worker))
    if entry is None:
        raise ValueError(f"the state has no entry for DataLoader worker {worker}: pass the "
                         f"DataLoader's whole state through ShardStream.collect_states")
    return entry

