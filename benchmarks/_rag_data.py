"""rag_qps.py's data: clustered synthetic embeddings, FAISS indexes over them, exact ground truth.

Embeddings from a sentence encoder are not uniform noise: they cluster by topic, vary along far
fewer directions than they have dimensions, and sit on the unit sphere. So each vector here is a
topic centre (``topics`` of them, of unequal sizes) plus a variation drawn in a random
``latent``-dimensional subspace plus a little isotropic noise, normalised (L2 distance on unit
vectors ranks as cosine does); queries are fresh draws from the same mixture. (With isotropic
noise alone, nearest neighbours are nearly meaningless in 384 dimensions and IVF-PQ's
recall@10 stays near 0.2; with this structure it is about 0.65 at nprobe 16, IVF-Flat's 1.0,
as with real embeddings.) Ground truth is an exact search over all vectors. Everything is cached in
the data directory, keyed by its parameters, and rebuilt only when they change.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from flashstream import write_index

KINDS = ("ivfpq", "ivfflat", "hnsw", "flat")
CHUNK = 65536  # vectors generated / added at a time (bounds temporary memory)


@dataclass(frozen=True)
class DataSpec:
    n: int
    dim: int
    queries: int = 1000
    topics: int = 1000
    latent: int = 48       # dimensions of the within-topic variation
    spread: float = 0.5    # norm of the within-topic variation (a centre has norm 1)
    noise: float = 0.1     # norm of the isotropic noise
    gt_k: int = 100
    seed: int = 0
    format: int = 1

    @property
    def key(self) -> str:
        return (f"n{self.n}-d{self.dim}-q{self.queries}-t{self.topics}-l{self.latent}"
                f"-sp{self.spread:g}-no{self.noise:g}-s{self.seed}-v{self.format}")


@dataclass(frozen=True)
class IndexSpec:
    kind: str
    nlist: int
    pq_m: int
    hnsw_m: int = 32
    train: int = 100_000

    def filename(self, data: DataSpec) -> str:
        shape = {"ivfpq": f"ivf{self.nlist}-pq{self.pq_m}", "ivfflat": f"ivf{self.nlist}-flat",
                 "hnsw": f"hnsw{self.hnsw_m}", "flat": "flat"}[self.kind]
        return f"{data.key}-{shape}.index"


def default_nlist(n: int) -> int:
    """About sqrt(n) lists, a power of two, at least 16 and with at least ~39 vectors each."""
    return int(max(16, min(2 ** round(np.log2(max(n, 1) ** 0.5)), n // 39 or 16)))


def default_pq_m(dim: int) -> int:
    """PQ sub-quantizers: 8 dimensions each (e.g. 48 bytes a vector at d=384)."""
    for m in (dim // 8, dim // 4, dim // 2, dim):
        if m >= 1 and dim % m == 0:
            return m
    return 1


class _Mixture:
    def __init__(self, spec: DataSpec) -> None:
        rng = np.random.default_rng(spec.seed)
        centres = rng.standard_normal((spec.topics, spec.dim)).astype(np.float32)
        self.centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)
        self.weights = rng.dirichlet(np.full(spec.topics, 0.5))  # some topics much larger
        latent = min(spec.latent, spec.dim)
        # Rows of norm ~1: z @ basis / sqrt(latent) has norm ~1 for z ~ N(0, I).
        self.basis = (rng.standard_normal((latent, spec.dim)) / np.sqrt(spec.dim)
                      * spec.spread / np.sqrt(latent)).astype(np.float32)
        self.noise = spec.noise / np.sqrt(spec.dim)
        self.dim = spec.dim

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        topic = rng.choice(len(self.centres), size=n, p=self.weights)
        z = rng.standard_normal((n, len(self.basis)), dtype=np.float32)
        x = self.centres[topic] + z @ self.basis
        x += self.noise * rng.standard_normal((n, self.dim), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x


def _vectors(spec: DataSpec, mixture: _Mixture, progress: Optional[Callable[[int], None]]):
    """The database vectors, chunk by chunk (each chunk seeded: the same data every time)."""
    for start in range(0, spec.n, CHUNK):
        rng = np.random.default_rng([spec.seed, 1, start])
        chunk = mixture.draw(min(CHUNK, spec.n - start), rng)
        if progress:
            progress(len(chunk))
        yield chunk


def _new_index(faiss, spec: IndexSpec, dim: int):
    if spec.kind == "flat":
        return faiss.IndexFlatL2(dim)
    if spec.kind == "hnsw":
        return faiss.IndexHNSWFlat(dim, spec.hnsw_m)
    quantizer = faiss.IndexFlatL2(dim)
    if spec.kind == "ivfflat":
        return faiss.IndexIVFFlat(quantizer, dim, spec.nlist)
    return faiss.IndexIVFPQ(quantizer, dim, spec.nlist, spec.pq_m, 8)


def build(directory: Path, data: DataSpec, index: IndexSpec,
          progress: Optional[Callable[[str, int, int], None]] = None) -> Dict[str, object]:
    """The index file, queries and ground truth for (data, index), built unless cached.

    Returns paths and build timings. ``progress(stage, done, total)`` reports vector counts."""
    import faiss

    directory.mkdir(parents=True, exist_ok=True)
    index_path = directory / index.filename(data)
    queries_path = directory / f"{data.key}-queries.npy"
    truth_path = directory / f"{data.key}-gt{data.gt_k}.npy"
    manifest_path = index_path.with_suffix(".json")
    wanted = {"data": asdict(data), "index": asdict(index)}
    if manifest_path.exists() and index_path.exists() and truth_path.exists():
        try:
            if json.loads(manifest_path.read_text())["params"] == wanted:
                return _paths(index_path, queries_path, truth_path, cached=True)
        except (ValueError, KeyError):
            pass
    mixture = _Mixture(data)
    queries = mixture.draw(data.queries, np.random.default_rng([data.seed, 2]))
    np.save(queries_path, queries)
    timings: Dict[str, float] = {}

    def report(stage):
        done = [0]

        def step(n):
            done[0] += n
            if progress:
                progress(stage, done[0], data.n)
        return step

    faiss.omp_set_num_threads(os.cpu_count() or 1)  # building is parallel, serving is not
    built = _new_index(faiss, index, data.dim)
    start = time.perf_counter()
    if not built.is_trained:
        # A sample of the same mixture (as one trains on a sample of a real corpus).
        built.train(mixture.draw(min(index.train, max(data.n, 39 * index.nlist)),
                                 np.random.default_rng([data.seed, 3])))
    timings["train_s"] = time.perf_counter() - start
    # Ground truth (unless another index over the same data made it) from the same pass.
    truth_index = None if truth_path.exists() else faiss.IndexFlatL2(data.dim)
    start = time.perf_counter()
    for chunk in _vectors(data, mixture, report("adding vectors")):
        built.add(chunk)
        if truth_index is not None:
            truth_index.add(chunk)
    timings["add_s"] = time.perf_counter() - start
    if truth_index is not None:
        start = time.perf_counter()
        truth = truth_index.search(queries, min(data.gt_k, data.n))[1]
        timings["ground_truth_s"] = time.perf_counter() - start
        del truth_index
        np.save(truth_path, truth)
    write_index(built, index_path)
    manifest_path.write_text(json.dumps({"params": wanted, "timings": timings}, indent=2))
    return _paths(index_path, queries_path, truth_path, cached=False, **timings)


def _paths(index_path: Path, queries_path: Path, truth_path: Path, **extra) -> Dict[str, object]:
    return {"index": index_path, "queries": queries_path, "ground_truth": truth_path,
            "index_bytes": index_path.stat().st_size, **extra}
