"""Seeded shuffling: shard order and a sample shuffle buffer."""

from __future__ import annotations

import random
from typing import Iterable, Iterator, List, Sequence, TypeVar

__all__ = ["rng_for", "shuffle_buffer", "shuffled"]

T = TypeVar("T")


def rng_for(*parts: object) -> random.Random:
    """A generator seeded from ``parts``; string seeds hash with SHA-512 in CPython, so the
    stream is the same in every process and run (unlike ``hash()``)."""
    return random.Random(":".join(str(p) for p in parts))


def shuffled(items: Sequence[T], rng: random.Random) -> List[T]:
    out = list(items)
    rng.shuffle(out)
    return out


def shuffle_buffer(samples: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """Yield ``samples`` through a buffer of ``size``: once it is full, each new sample
    replaces a randomly chosen one, which is yielded; the rest is shuffled at the end."""
    buffer: List[T] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        index = rng.randrange(size)
        yield buffer[index]
        buffer[index] = sample
    rng.shuffle(buffer)
    yield from buffer
