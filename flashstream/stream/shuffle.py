"""Seeded shuffling: shard order, and a sample buffer whose state is small and exact.

The buffer draws its indices from :class:`Draws`, whose whole state is the number of draws
made: a resumed buffer replays that many draws from the same seed and continues exactly where
the uninterrupted one would have. The same buffer runs over real samples (shard plan) and
over sample numbers (sample plan, where every worker computes the rank's output order).
"""

from __future__ import annotations

import random
from array import array
from typing import Generic, List, Optional, Sequence, TypeVar, overload

__all__ = ["Draws", "ShardDraws", "ShuffleBuffer", "buffer_order", "rng_for"]

T = TypeVar("T")


def rng_for(*parts: object) -> random.Random:
    """A generator seeded from ``parts``; string seeds hash with SHA-512 in CPython, so the
    stream is the same in every process and run (unlike ``hash()``)."""
    return random.Random(":".join(str(p) for p in parts))


class Draws:
    """Uniform indices from a seeded generator; ``count`` (draws made) is its whole state.

    Every draw consumes exactly one ``random()`` value, so skipping ``count`` draws puts a new
    generator in the same state as the old one, whatever bounds were asked for.
    """

    def __init__(self, *parts: object, skip: int = 0) -> None:
        self._random = rng_for(*parts).random
        for _ in range(skip):
            self._random()
        self.count = skip

    def below(self, n: int) -> int:
        self.count += 1
        return int(self._random() * n)  # n is far below 2**53: never equals n


class ShuffleBuffer(Generic[T]):
    """webdataset's shuffle buffer, one step at a time so that its state can be saved.

    Until ``size`` items are held, ``push`` keeps them (and returns None); after that each push
    swaps the new item for a randomly chosen one and returns that. When the input ends,
    ``drain`` returns the held items in random order, one per call. Items are never None.
    """

    def __init__(self, size: int, draws: Draws, items: Sequence[T] = ()) -> None:
        self.size = size
        self.draws = draws
        self.items: List[T] = list(items)

    def push(self, item: T) -> Optional[T]:
        """Add ``item``; the item that leaves in exchange (None while filling)."""
        items = self.items
        if len(items) < self.size:
            items.append(item)
            return None
        index = self.draws.below(self.size)
        out = items[index]
        items[index] = item
        return out

    def drain(self) -> T:
        """Take a random remaining item (the input has ended)."""
        index = self.draws.below(len(self.items))
        out = self.items[index]
        last = self.items.pop()
        if index < len(self.items):
            self.items[index] = last
        return out

    def __len__(self) -> int:
        return len(self.items)


def buffer_order(n: int, size: int, draws: Draws) -> array:
    """The order in which a buffer of ``size`` releases the inputs ``0..n-1``: element ``p``
    is the input delivered ``p``-th. Exactly what :class:`ShuffleBuffer` does to real items."""
    buffer: ShuffleBuffer[int] = ShuffleBuffer(size, draws)
    out = array("q")
    push, append = buffer.push, out.append
    for i in range(n):
        left = push(i)
        if left is not None:
            append(left)
    while len(buffer):
        append(buffer.drain())
    return out


class ShardDraws(Sequence[int]):
    """Shards drawn with replacement (resampled): element ``i`` is a draw from ``n_shards``,
    a pure function of ``parts`` (seed, epoch, rank, worker) and ``i``, so a resumed pass finds
    the same shards at the same places. Draws are made 1024 at a time, on demand."""

    _BLOCK = 1024

    def __init__(self, n_shards: int, count: int, *parts: object) -> None:
        if n_shards < 1:
            raise ValueError("resampling needs at least one shard")
        self.n_shards = n_shards
        self.count = count
        self.parts = parts
        self._block = -1
        self._draws: List[int] = []

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> List[int]: ...

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if not 0 <= i < self.count:
            raise IndexError(i)
        block = i // self._BLOCK
        if block != self._block:
            rng = rng_for("resampled", *self.parts, block)
            self._draws = [rng.randrange(self.n_shards) for _ in range(self._BLOCK)]
            self._block = block
        return self._draws[i % self._BLOCK]
