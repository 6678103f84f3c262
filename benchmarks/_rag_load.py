"""rag_qps.py's helpers: readers configured for the index type, and background loads.

The loads are what a training job does to the drive a RAG service shares: CheckpointWriter
saving a state dict again and again (keep=1, so old checkpoints are deleted), unpaced or paced
(WriteLoad), or a ShardStream reading WebDataset shards epoch after epoch (EpochLoad).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Dict, Optional

from flashstream import IndexReader


def open_reader(path: Path, use_mmap: bool, knobs: Dict[str, int], io: str = "mmap",
                list_cache: int = 0) -> IndexReader:
    """An IndexReader with nprobe / ef_search set where the index type has them."""
    reader = IndexReader(path, io=io, mmap=use_mmap, list_cache=list_cache)
    kind = reader.info()["kind"]
    if kind.startswith("IndexIVF"):
        reader.configure(nprobe=knobs["nprobe"])
    elif kind == "IndexHNSWFlat":
        reader.configure(ef_search=knobs["ef_search"])
    return reader


class _Background:
    """A load that runs in a thread from ``__enter__`` until ``__exit__``: ``_work()`` loops
    until ``_stop`` is set; an error it raises is raised again by ``__exit__``."""

    name = "load"

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _work(self) -> None:
        raise NotImplementedError

    def _cleanup(self) -> None:
        pass

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._work()
        except BaseException as e:  # re-raised by __exit__
            self._error = e
        self.seconds = time.perf_counter() - start

    def __enter__(self):
        self._thread.start()
        time.sleep(0.5)  # let the load get going before the measurements start
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._cleanup()
        if self._error is not None and exc[0] is None:
            raise self._error

    def gbps(self) -> Optional[float]:
        return self.bytes / self.seconds / 1e9 if self.seconds else None


class WriteLoad(_Background):
    """CheckpointWriter saves back to back in a thread, from ``__enter__`` until ``__exit__``."""

    name = "write-load"

    def __init__(self, directory: Path, size: int, rate: Optional[float]) -> None:
        import torch

        # One core for the snapshot copies: the load stands for another job's checkpoints, which
        # would run on that job's own cores; what we want to see is the drive's contention.
        torch.set_num_threads(1)
        super().__init__()
        self.directory, self.rate = directory, rate
        self.state = {"weights": torch.randn(max(1, size // 4))}
        self.saves = 0

    def _work(self) -> None:
        from flashstream import CheckpointWriter

        shutil.rmtree(self.directory, ignore_errors=True)
        with CheckpointWriter(self.directory, rate=self.rate, keep=1) as writer:
            step = 0
            while not self._stop.is_set():
                report = writer.save(self.state, step=step).result()
                self.bytes += report.bytes
                self.saves += 1
                step += 1

    def _cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def summary(self) -> Dict[str, object]:
        return {"rate": self.rate, "saves": self.saves, "bytes": self.bytes,
                "seconds": self.seconds, "gbps": self.gbps()}


class EpochLoad(_Background):
    """ShardStream epochs back to back in a thread, from ``__enter__`` until ``__exit__``, over
    ``size`` bytes of 1 MiB samples in 64 MiB shards written once under ``directory``."""

    name = "epoch-load"
    SAMPLE = 1 << 20
    SHARD = 64 << 20

    def __init__(self, directory: Path, size: int) -> None:
        super().__init__()
        self.urls = self._shards(directory, size)
        self.epochs = 0

    @classmethod
    def _shards(cls, directory: Path, size: int) -> list:
        import os

        from flashstream import ShardWriter

        per_shard = cls.SHARD // cls.SAMPLE
        count = max(1, -(-size // cls.SHARD))
        urls = [str(directory / f"epoch-{i:04d}.tar") for i in range(count)]
        done = directory / f"epoch-{count}-shards.done"
        if not done.exists():
            directory.mkdir(parents=True, exist_ok=True)
            payload = os.urandom(cls.SAMPLE)
            with ShardWriter(str(directory / "epoch-%04d.tar"), maxcount=per_shard,
                             verbose=0) as writer:
                for i in range(count * per_shard):
                    writer.write({"__key__": f"{i:08d}", "bin": payload})
            done.touch()
        return urls

    def _work(self) -> None:
        from flashstream import ShardStream, pagecache

        while not self._stop.is_set():
            pagecache.evict(self.urls)  # each epoch reads the drive
            for sample in ShardStream(self.urls):
                self.bytes += len(sample["bin"])
                if self._stop.is_set():
                    break
            else:
                self.epochs += 1

    def summary(self) -> Dict[str, object]:
        return {"kind": "ShardStream epochs", "epochs": self.epochs, "bytes": self.bytes,
                "seconds": self.seconds, "gbps": self.gbps()}
