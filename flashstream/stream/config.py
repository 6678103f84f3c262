"""A stream's configuration: the arguments that decide order and splits, validated once."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Union

from .plan import EQUAL_RULES

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "StreamConfig", "equal_rule", "shuffle_config"]

DEFAULT_SHUFFLE_BUFFER = 1000


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    shuffle_buffer: int
    shard_shuffle: bool
    seed: int
    split_by_rank: bool
    split_by_worker: bool
    equal_ranks: Optional[str]
    batch_size: int
    lanes: int
    resampled: bool = False

    def __post_init__(self) -> None:
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle must be True, False or a buffer size >= 0, "
                             f"got {self.shuffle_buffer}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if (isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                or self.batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if isinstance(self.lanes, bool) or not isinstance(self.lanes, int) or self.lanes < 1:
            raise ValueError(f"lanes must be None or an int >= 1, got {self.lanes!r}")
        if not isinstance(self.resampled, bool):
            raise ValueError(f"resampled must be True or False, got {self.resampled!r}")

    def identity_config(self) -> Dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle_buffer,
                "shard_shuffle": self.shard_shuffle, "equal_ranks": self.equal_ranks,
                "split_by_rank": self.split_by_rank, "split_by_worker": self.split_by_worker,
                "lanes": self.lanes, **({"resampled": True} if self.resampled else {})}


def shuffle_config(shuffle: Union[bool, int]) -> tuple:
    if shuffle is True:
        return DEFAULT_SHUFFLE_BUFFER, True
    if shuffle is False or shuffle is None:
        return 0, False
    if isinstance(shuffle, int):
        return shuffle, shuffle > 0
    raise ValueError(f"shuffle must be True, False or a buffer size (int), got {shuffle!r}")


def equal_rule(equal_ranks: Union[bool, str]) -> Optional[str]:
    if equal_ranks is False or equal_ranks is None:
        return None
    if equal_ranks is True:
        return "drop"
    if isinstance(equal_ranks, str) and equal_ranks in EQUAL_RULES:
        return equal_ranks
    raise ValueError(f"equal_ranks must be False, True (= 'drop'), 'drop' or 'repeat'; "
                     f"got {equal_ranks!r}")
