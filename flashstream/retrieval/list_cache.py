"""Which inverted lists are in memory: a byte budget shared by every thread searching a reader.

A search holds the lists it probes from before they are fetched until its scan returns; a held
list is never dropped, whatever the budget or an ``evict_all()`` says (the scan reads its bytes
in place, and a dropped list reads as zeros: wrong ids, silently). A list another search is
fetching is waited for, not fetched twice.

Policy: a segmented LRU. A fetched list enters on probation; a list used again while resident
moves to the protected segment (at most ``PROTECTED_SHARE`` of the budget, its least recently
used lists going back to probation). Lists are dropped from probation first. Under a skewed
query stream the lists of popular queries are used again and again and stay protected, while
the one-off lists of rare queries pass through probation without pushing them out, which plain
LRU would let them do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

__all__ = ["PROTECTED_SHARE", "CacheStats", "ListCache", "Pending"]

#: Share of the budget the protected (used more than once) segment may fill.
PROTECTED_SHARE = 0.8

_ABSENT, _FETCHING, _RESIDENT = 0, 1, 2


class Pending:
    """A fetch in progress on another thread: ``wait()`` returns once the list is in memory,
    or raises what that fetch raised."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException]) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


@dataclass(frozen=True)
class CacheStats:
    budget: int
    resident_bytes: int   # lists in memory or being fetched into it
    resident_lists: int
    peak_bytes: int       # highest resident_bytes so far (above the budget only while held)
    hits: int             # lists a search found in memory
    misses: int           # lists a search fetched
    shared: int           # lists a search waited for while another fetched them
    evictions: int
    fetched_bytes: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses + self.shared
        return (self.hits + self.shared) / total if total else 0.0

    def to_dict(self) -> Dict[str, float]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["hit_rate"] = self.hit_rate
        return out


class ListCache:
    """Residency, holds and the budget for ``len(nbytes)`` lists of ``nbytes[i]`` bytes each.

    ``drop(i, occupied)`` frees list i's memory; it is called with the cache's lock held, and
    ``occupied(j)`` says whether list j is still in memory (or being fetched), so memory shared
    with a neighbour (a page) is freed only with the last list on it."""

    def __init__(self, nbytes: np.ndarray, budget: int,
                 drop: Callable[[int, Callable[[int], bool]], None]) -> None:
        if budget < 0:
            raise ValueError(f"the list cache budget must be >= 0 bytes, got {budget}")
        self.budget = int(budget)
        self._nbytes = [int(n) for n in nbytes]
        self._state = bytearray(len(self._nbytes))
        self._holds = [0] * len(self._nbytes)
        self._pending: Dict[int, Pending] = {}
        self._doomed: Set[int] = set()  # dropped by evict_all() while held: drop at release
        self._probation: OrderedDict = OrderedDict()
        self._protected: OrderedDict = OrderedDict()
        self._protected_bytes = 0
        self._resident = 0
        self._drop = drop
        self._lock = threading.Lock()
        self._counts = dict(peak_bytes=0, hits=0, misses=0, shared=0, evictions=0,
                            fetched_bytes=0)

    # -- a search's lists ------------------------------------------------------------------------
    def acquire(self, lists: Iterable[int]) -> Tuple[List[int], List[Pending]]:
        """Hold ``lists`` (distinct, non-empty). Returns the lists this caller must fetch (then
        call :meth:`fetched`) and the fetches of other threads to wait for. Every list stays
        held until :meth:`release`, whatever happens meanwhile."""
        fetch: List[int] = []
        waits: List[Pending] = []
        holds, state, protected = self._holds, self._state, self._protected
        hits = 0
        with self._lock:
            for i in lists:
                holds[i] += 1
                now = state[i]
                if now == _RESIDENT:
                    hits += 1
                    if i in protected:
                        protected.move_to_end(i)
                    else:
                        self._promote(i)
                elif now == _FETCHING:
                    waits.append(self._pending[i])
                else:
                    state[i] = _FETCHING
                    self._pending[i] = Pending()
                    self._resident += self._nbytes[i]
                    fetch.append(i)
            counts = self._counts
            counts["hits"] += hits
            counts["shared"] += len(waits)
            counts["misses"] += len(fetch)
            if fetch:
                self._make_room()
                counts["peak_bytes"] = max(counts["peak_bytes"], self._resident)
        return fetch, waits

    def fetched(self, lists: List[int], error: Optional[BaseException] = None) -> None:
        """The caller's fetch of ``lists`` (from :meth:`acquire`) is done, or failed."""
        with self._lock:
            for i in lists:
                pending = self._pending.pop(i)
                if error is None:
                    self._state[i] = _RESIDENT
                    self._probation[i] = None
                    self._counts["fetched_bytes"] += self._nbytes[i]
                else:
                    self._forget(i)
                pending.finish(error)

    def release(self, lists: Iterable[int]) -> None:
        """The scan that held ``lists`` is over; lists over the budget may go now."""
        with self._lock:
            holds, doomed = self._holds, self._doomed
            for i in lists:
                holds[i] -= 1
                if doomed and not holds[i] and i in doomed and self._state[i] == _RESIDENT:
                    self._evict(i)
            if self._resident > self.budget:
                self._make_room()

    # -- the whole cache -------------------------------------------------------------------------
    def evict_all(self) -> int:
        """Drop every list; a held one goes when its scan releases it. Returns lists dropped."""
        with self._lock:
            resident = [*self._probation, *self._protected]
            dropped = 0
            for i in resident:
                if self._holds[i]:
                    self._doomed.add(i)
                else:
                    self._evict(i)
                    dropped += 1
            self._doomed.update(self._pending)  # fetching now: held, so dropped at release
            return dropped

    def is_resident(self, i: int) -> bool:
        return self._state[i] == _RESIDENT

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(budget=self.budget, resident_bytes=self._resident,
                              resident_lists=len(self._probation) + len(self._protected),
                              **self._counts)

    # -- internals (lock held) -------------------------------------------------------------------
    def _promote(self, i: int) -> None:
        """A list on probation used again: into the protected segment."""
        del self._probation[i]
        self._protected[i] = None
        self._protected_bytes += self._nbytes[i]
        cap = PROTECTED_SHARE * self.budget
        while self._protected_bytes > cap and len(self._protected) > 1:
            j, _ = self._protected.popitem(last=False)
            self._protected_bytes -= self._nbytes[j]
            self._probation[j] = None

    def _make_room(self) -> None:
        if self._resident <= self.budget:
            return
        for segment in (self._probation, self._protected):
            while self._resident > self.budget:
                victim = next((j for j in segment if not self._holds[j]), None)
                if victim is None:
                    break  # all held: over the budget until their scans release them
                self._evict(victim)

    def _evict(self, i: int) -> None:
        if i in self._probation:
            del self._probation[i]
        else:
            del self._protected[i]
            self._protected_bytes -= self._nbytes[i]
        self._counts["evictions"] += 1
        self._forget(i)

    def _forget(self, i: int) -> None:
        self._state[i] = _ABSENT
        self._doomed.discard(i)
        self._resident -= self._nbytes[i]
        self._drop(i, self._occupied)

    def _occupied(self, j: int) -> bool:
        return self._state[j] != _ABSENT
