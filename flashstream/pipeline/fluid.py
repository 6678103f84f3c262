"""webdataset's fluid methods (``.shuffle().decode().to_tuple().batched()``...) for flashstream.

The same names, arguments and results as ``webdataset.FluidInterface`` (its own stage
functions and decoders do the work), on ``ShardStream`` and on the ``Pipeline`` they return.
What differs is what flashstream adds: ``.shuffle(n)`` is the stream's own resumable buffer,
``batched`` does not read ahead, and the result resumes exactly (see docs/pipeline.md).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import webdataset.autodecode as wda
import webdataset.filters as wf

from ..stream.handlers import resolve_handler
from .stages import Batch, Each, Opaque, Slice, from_webdataset, unbatch_stage

__all__ = ["FluidInterface"]

_RERAISE = wf.reraise_exception


def _handler(handler: Any) -> Callable[[BaseException], bool]:
    """webdataset's handler callables, or flashstream's names ("reraise", "warn", "ignore")."""
    return resolve_handler(handler)


class FluidInterface:
    """Mixed into ShardStream and Pipeline; both provide ``_compose(*stages)``,
    ``_shuffled(size)`` and ``_epoch(items, repetitions)``."""

    def _compose(self, *stages: Any) -> Any:
        raise NotImplementedError

    def _shuffled(self, size: int, original: Any = None, **kw: Any) -> Any:
        raise NotImplementedError

    def _epoch(self, *, items: Optional[int], repetitions: int) -> Any:
        raise NotImplementedError

    # -- webdataset's stages ------------------------------------------------------------------
    def compose(self, *stages: Any) -> Any:
        """Append stages: webdataset's (``wds.map(f)``, ``wds.batched(16)``, ...; resumed
        exactly) or any function of an iterator (run as given, resumed as if it held
        nothing)."""
        out = self
        for stage in stages:
            translated = from_webdataset(stage)
            if isinstance(translated, tuple):  # ("shuffle", bufsize, stage)
                _, size, original = translated
                out = out if size < 1 else out._shuffled(size, original)
            else:
                out = out._compose(translated)
        return out

    def shuffle(self, size: int, **kw: Any) -> Any:
        """Shuffle samples through a buffer of ``size`` (``size < 1``: unchanged). Before any
        batching it is the stream's own seeded, resumable buffer (``initial``, ``rng`` and
        ``seed`` are accepted; the order comes from the stream's seed and the epoch); after
        batching it is webdataset's own shuffle of the items, with these arguments."""
        unknown = set(kw) - {"initial", "rng", "seed", "handler"}
        if unknown:
            raise ValueError(f"shuffle() got unexpected argument(s) {sorted(unknown)}; allowed: "
                             f"size, initial, rng, seed, handler")
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"shuffle size must be an int, got {size!r}")
        return self if size < 1 else self._shuffled(size, **kw)

    def map(self, f: Callable[[Any], Any], handler: Any = _RERAISE) -> Any:
        """``f(sample)`` for each sample; a None result drops the sample (as webdataset)."""
        return self._compose(Each(wf.map(f, handler=_handler(handler)), "map"))

    def decode(self, *args: Any, pre: Any = None, post: Any = None, only: Any = None,
               partial: bool = False, handler: Any = _RERAISE) -> Any:
        """webdataset's decoders: image specs (``"pil"``, ``"torchrgb8"``, ...) or handler
        functions, with its default handlers for text, json, pickle-free formats."""
        handlers = [wda.ImageHandler(x) if isinstance(x, str) else x for x in args]
        decoder = wda.Decoder(handlers, pre=pre, post=post, only=only, partial=partial)
        return self._compose(Each(wf.map(decoder, handler=_handler(handler)), "decode"))

    def map_dict(self, handler: Any = _RERAISE, **kw: Callable[[Any], Any]) -> Any:
        return self._compose(Each(wf.map_dict(handler=_handler(handler), **kw), "map_dict"))

    def select(self, predicate: Callable[[Any], bool], **kw: Any) -> Any:
        return self._compose(Each(wf.select(predicate, **kw), "select", drops=True))

    def to_tuple(self, *args: Any, **kw: Any) -> Any:
        if "handler" in kw:
            kw["handler"] = _handler(kw["handler"])
        return self._compose(Each(wf.to_tuple(*args, **kw), "to_tuple"))

    def map_tuple(self, *args: Any, handler: Any = _RERAISE) -> Any:
        return self._compose(Each(wf.map_tuple(*args, handler=_handler(handler)), "map_tuple"))

    def rename(self, **kw: Any) -> Any:
        if "handler" in kw:
            kw["handler"] = _handler(kw["handler"])
        return self._compose(Each(wf.rename(**kw), "rename"))

    def rename_keys(self, *args: Any, **kw: Any) -> Any:
        return self._compose(Each(wf.rename_keys(*args, **kw), "rename_keys"))

    def extract_keys(self, *args: Any, **kw: Any) -> Any:
        return self._compose(Each(wf.extract_keys(*args, **kw), "extract_keys"))

    def xdecode(self, *args: Any, **kw: Any) -> Any:
        return self._compose(Each(wf.xdecode(*args, **kw), "xdecode"))

    def rsample(self, p: float = 0.5) -> Any:
        """Keep each sample with probability ``p`` (webdataset's, unseeded: a resumed pass
        draws anew)."""
        return self._compose(Each(wf.rsample(p), "rsample", drops=True))

    def log_keys(self, logfile: Optional[str] = None) -> Any:
        """Append each sample's key and url to ``logfile`` as it passes (webdataset's)."""
        return self._compose(Each(wf.log_keys(logfile), "log_keys"))

    def slice(self, *args: int) -> Any:
        """``itertools.islice`` of the items: ``slice(stop)`` or ``slice(start, stop[, step])``,
        per DataLoader worker as in webdataset; resumed exactly."""
        return self._compose(Slice.of(*args))

    def mcached(self) -> Any:
        """webdataset's ``Cached``: the first pass is kept in memory and replayed after."""
        stage = wf.Cached()
        return self._compose(Opaque(stage.run, "mcached"))

    def lmdb_cached(self, *args: Any, **kw: Any) -> Any:
        """webdataset's ``LMDBCached(fname, ...)``: samples cached in an LMDB database."""
        stage = wf.LMDBCached(*args, **kw)
        return self._compose(Opaque(stage.run, "lmdb_cached"))

    def batched(self, batchsize: int, collation_fn: Optional[Callable[[list], Any]] = (
            wf.default_collation_fn), partial: bool = True) -> Any:
        """Batches of ``batchsize``, collated by webdataset's ``default_collation_fn`` (or
        ``collation_fn``; None: plain lists). On the sample plan a batch is the survivors of
        one planned block of ``batchsize`` samples (see docs/pipeline.md)."""
        name = "batched" if collation_fn is not None else "listed"
        return self._compose(Batch(batchsize, collation_fn, partial, name))

    def listed(self, batchsize: int, partial: bool = True) -> Any:
        return self.batched(batchsize, collation_fn=None, partial=partial)

    def unbatched(self) -> Any:
        return self._compose(unbatch_stage("unbatched"))

    def unlisted(self) -> Any:
        return self._compose(unbatch_stage("unlisted"))

    # -- epochs -------------------------------------------------------------------------------
    def with_epoch(self, nsamples: int = -1, nbatches: int = -1) -> Any:
        """An epoch of ``max(nsamples, nbatches)`` items (what the pipeline yields, e.g.
        batches after ``batched``), repeating the data as needed. Sample plan: items of the
        rank, all DataLoader workers together; shard plan: items per worker, as webdataset."""
        n = max(nsamples, nbatches)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"with_epoch needs nsamples or nbatches >= 1, got {n!r}")
        return self._epoch(items=n, repetitions=sys.maxsize)

    def repeat(self, nepochs: int = -1, nbatches: int = -1) -> Any:
        """``nepochs`` passes over the data per epoch (each ordered anew); ``nepochs <= 0``:
        endless. ``nbatches > 0`` cuts the epoch at that many items (as webdataset, not with
        ``nepochs == 1``)."""
        repetitions = nepochs if nepochs > 0 else sys.maxsize
        if repetitions == 1:  # webdataset cuts at nbatches only when it repeats
            nbatches = -1
        return self._epoch(items=nbatches if nbatches > 0 else None, repetitions=repetitions)
