"""The loaders benchmarks/epoch.py times, each written the way a training script would be.

    inprocess           ShardStream iterated in this process, sample by sample
    tensors             ShardStream(...).tensors(B) through DataLoader(num_workers=N)
    webdataset          webdataset's idiomatic chain .map(to_tensor).batched(B), same loader
    decode_flashstream  flashstream.WebDataset(...).decode("torchrgb8").to_tuple("jpg", "cls")
                        .batched(B), same loader (the JPEG profile)
    decode_webdataset   the same chain on webdataset.WebDataset

Functions the DataLoader workers call are module-level, so they pickle under any start method.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import flashstream

__all__ = ["DATA_LOADERS", "DECODE_LOADERS", "Loader", "make_loader"]


def to_tensor(sample: Dict[str, Any]) -> Dict[str, Any]:
    """What a webdataset script does per sample: payloads to uint8 tensors, labels to ints."""
    import torch

    out: Dict[str, Any] = {}
    for key, value in sample.items():
        if isinstance(value, bytes):
            text = value.strip()
            if 0 < len(text) < 12 and text.isdigit():
                out[key] = int(text)
            else:
                out[key] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
        else:
            out[key] = value
    return out


def stack_or_list(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """webdataset's default collation where shapes agree; a list where they do not (payloads
    of different lengths cannot be stacked)."""
    import torch

    out: Dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor) and len({v.shape for v in values}) == 1:
            out[key] = torch.stack(values)
        elif isinstance(values[0], int):
            out[key] = torch.tensor(values)
        else:
            out[key] = values
    return out


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["__key__"])
    return len(batch[0])


@dataclasses.dataclass
class Loader:
    """What one timed epoch iterates, how many samples an item holds, and the flashstream
    dataset behind it (for EpochMonitor and its read statistics), if any."""

    items: Any
    count: Callable[[Any], int]
    dataset: Optional[Any] = None

    def start_workers(self) -> None:
        """Start persistent DataLoader workers (one item, untimed), so that timed epochs
        measure reading, as they would in a long training run."""
        if getattr(self.items, "persistent_workers", False):
            it = iter(self.items)
            next(it, None)
            del it


def _loader(dataset: Any, args: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=None, num_workers=args.workers,
                      persistent_workers=args.persistent_workers)


def _stream(paths: List[Path], args: Any, **kw: Any) -> flashstream.ShardStream:
    return flashstream.ShardStream([str(p) for p in paths], engine=args.engine,
                                   chunk_size=args.chunk_size, queue_depth=args.queue_depth,
                                   **kw)


def _inprocess(paths: List[Path], args: Any) -> Loader:
    stream = _stream(paths, args)
    return Loader(stream, lambda _sample: 1, stream)


def _tensors(paths: List[Path], args: Any) -> Loader:
    dataset = _stream(paths, args).tensors(args.batch_size)
    return Loader(_loader(dataset, args), batch_size_of, dataset)


def _webdataset(paths: List[Path], args: Any) -> Loader:
    import webdataset as wds

    # empty_check=False: a worker left without a shard yields nothing, as ours does.
    dataset = (wds.WebDataset([str(p) for p in paths], shardshuffle=False, empty_check=False)
               .map(to_tensor).batched(args.batch_size, collation_fn=stack_or_list))
    return Loader(_loader(dataset, args), batch_size_of)


def _decode_chain(dataset: Any, args: Any) -> Any:
    return dataset.decode("torchrgb8").to_tuple("jpg", "cls").batched(args.batch_size)


def _decode_flashstream(paths: List[Path], args: Any) -> Loader:
    dataset = _decode_chain(flashstream.WebDataset(
        [str(p) for p in paths], shardshuffle=False, empty_check=False, engine=args.engine,
        chunk_size=args.chunk_size, queue_depth=args.queue_depth), args)
    return Loader(_loader(dataset, args), batch_size_of, dataset)


def _decode_webdataset(paths: List[Path], args: Any) -> Loader:
    import webdataset as wds

    dataset = _decode_chain(wds.WebDataset([str(p) for p in paths], shardshuffle=False,
                                           empty_check=False), args)
    return Loader(_loader(dataset, args), batch_size_of)


_MAKERS = {"inprocess": _inprocess, "tensors": _tensors, "webdataset": _webdataset,
           "decode_flashstream": _decode_flashstream, "decode_webdataset": _decode_webdataset}
DATA_LOADERS = ("inprocess", "tensors", "webdataset")
DECODE_LOADERS = ("decode_flashstream", "decode_webdataset")


def make_loader(name: str, paths: List[Path], args: Any) -> Loader:
    return _MAKERS[name](paths, args)
