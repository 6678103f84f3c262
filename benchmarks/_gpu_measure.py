"""What benchmarks/gpu.py measures, each on a given device ("cuda", or "cpu" for the smoke run
that keeps the script from rotting on machines without a GPU: its figures are not GPU figures).

    copy_rate      the card's pinned device-to-host copy rate (the snapshot's physical limit)
    save_stall     CheckpointWriter.save of device state (the stall, and D2H during it) against
                   torch.save and torch.distributed.checkpoint.async_save of the same state
    loads          load_checkpoint(map_location=device) against torch.load and safetensors
    train_loop     a small conv net fed uint8 batches through DataLoader(pin_memory=True),
                   each batch's transfer overlapped with the previous one's compute
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import torch

from flashstream import CheckpointWriter, load_checkpoint
from flashstream.checkpoint import reading
from flashstream.pagecache import evict

__all__ = ["copy_rate", "loads", "make_state", "read_rates", "save_stall", "train_loop"]

_TENSOR_BYTES = 64 << 20  # state in tensors of this size, as a large model's layers are


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> Tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def make_state(nbytes: int, device: str) -> Dict[str, torch.Tensor]:
    """fp32 tensors of _TENSOR_BYTES (the last one smaller) totalling ``nbytes`` on ``device``."""
    state, left, i = {}, nbytes, 0
    while left > 0:
        size = min(_TENSOR_BYTES, left)
        state[f"layer{i:05d}.weight"] = torch.empty(max(1, size // 4), device=device).uniform_()
        left -= size
        i += 1
    return state


def copy_rate(nbytes: int, device: str, repeats: int = 3) -> Dict[str, float]:
    """Best of ``repeats`` device-to-host copies into pinned memory (plain on the CPU), GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst.copy_(src, non_blocking=True)  # warm: first touch, driver mappings
    sync(device)
    best = min(timed(device, lambda: dst.copy_(src, non_blocking=True))[0]
               for _ in range(repeats))
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9}


def save_stall(state: Dict[str, torch.Tensor], workdir: Path, device: str) -> Dict[str, Any]:
    """Stall of each save (reserved staging, so the first is not the slow one), against
    torch.save and DCP's async_save of the same state. Files are removed afterwards, except the
    flashstream checkpoint (returned, for the loads)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: Dict[str, Any] = {"bytes": nbytes}
    ours = workdir / "flashstream"
    with CheckpointWriter(ours, rate=None, keep=1, snapshot="copy", reserve=state) as writer:
        stalls = []
        for step in (1, 2):
            stall, handle = timed(device, lambda s=step: writer.save(state, step=s))
            stalls.append(stall)
            report = handle.result()
        out["flashstream"] = {"stalls_s": stalls, "stall_s": min(stalls),
                              "d2h_gbps": nbytes / min(stalls) / 1e9,
                              "write_gbps": getattr(report, "gbps", None),
                              "pinned": writer._staging.pinned}
    out["file"] = str(next(ours.glob("step-*/*.safetensors")))
    pt = workdir / "state.pt"
    seconds, _ = timed(device, lambda: torch.save(state, pt))
    out["torch_save"] = {"seconds": seconds}
    out["pt_file"] = str(pt)
    out["dcp_async_save"] = _dcp(state, workdir / "dcp", device)
    return out


def _dcp(state: Dict[str, torch.Tensor], directory: Path, device: str) -> Dict[str, Any]:
    try:
        import torch.distributed.checkpoint as dcp

        stall, future = timed(device, lambda: dcp.async_save(state, checkpoint_id=str(directory)))
        start = time.perf_counter()
        future.result()
        return {"stall_s": stall, "then_s": time.perf_counter() - start}
    except Exception as err:  # noqa: BLE001 - recorded in the JSON, the run goes on
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def loads(file: str, pt_file: str, device: str,
          windows: Sequence[Tuple[int, int]] = ()) -> Dict[str, Any]:
    """Each load from a cold page cache, onto ``device``, synchronized; the results freed.
    ``windows``: (chunk, depth) read windows to load with besides the loader's own."""
    import safetensors.torch

    ways = {
        "flashstream": lambda: load_checkpoint(file, map_location=device),
        "torch_load": lambda: torch.load(pt_file, map_location=device, weights_only=True),
        "safetensors": lambda: safetensors.torch.load_file(file, device=device),
    }
    if device != "cpu":  # the read alone, so the copy to the device can be told apart
        ways["flashstream_to_host"] = lambda: load_checkpoint(file, map_location="cpu")
    for chunk, depth in windows:
        ways[f"flashstream_window_{chunk >> 20}MiBx{depth}"] = \
            lambda c=chunk, d=depth: _with_window(c, d, lambda: load_checkpoint(
                file, map_location=device))
    out: Dict[str, Any] = {"bytes": os.stat(file).st_size}
    for name, fn in ways.items():
        evict([file, pt_file])
        try:
            seconds, loaded = timed(device, fn)
            out[name] = {"seconds": seconds}
            del loaded
        except Exception as err:  # noqa: BLE001
            out[name] = {"error": f"{type(err).__name__}: {err}"}
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


#: (chunk bytes, requests in flight): the checkpoint loader's read window, then deeper ones.
READ_WINDOWS = ((reading._CHUNK, reading._DEPTH), (4 << 20, 32), (8 << 20, 16),
                (16 << 20, 16))


def read_rates(file: str, windows: Sequence[Tuple[int, int]] = READ_WINDOWS) -> Dict[str, Any]:
    """What the drive gives one cold sequential read of ``file``: the engine's aligned O_DIRECT
    reads at each window, and plain buffered reads (16 MiB), GB/s, nothing copied."""
    from flashstream import engine
    from flashstream.settings import IOSettings

    size = os.stat(file).st_size
    out: Dict[str, Any] = {"bytes": size}
    for chunk, depth in windows:
        evict([file])
        reader = engine.open_reader([(file, 0, size)], IOSettings(chunk_size=chunk,
                                                                  queue_depth=depth))
        start, n = time.perf_counter(), 0
        while (got := reader.next()) is not None:
            n += len(got[2])
        seconds = time.perf_counter() - start
        reader.close()
        out[f"direct {chunk >> 20} MiB x {depth}"] = {"gbps": n / seconds / 1e9,
                                                     "engine": reader.engine}
    evict([file])
    buf = bytearray(16 << 20)
    start, n = time.perf_counter(), 0
    with open(file, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    out["buffered 16 MiB"] = {"gbps": n / (time.perf_counter() - start) / 1e9}
    return out


def _with_window(chunk: int, depth: int, fn: Callable[[], Any]) -> Any:
    saved = reading._CHUNK, reading._DEPTH
    reading._CHUNK, reading._DEPTH = chunk, depth
    try:
        return fn()
    finally:
        reading._CHUNK, reading._DEPTH = saved


class DevicePrefetch:
    """Iterate ``batches`` as device tensors, the next batch's host-to-device copy queued on a
    copy stream before the current batch is handed over, so it overlaps that batch's compute.
    On the CPU it only converts."""

    def __init__(self, batches: Iterable[Any], device: str, get: Callable[[Any], torch.Tensor]):
        self.batches, self.device, self.get = batches, device, get
        self.stream = torch.cuda.Stream() if device.startswith("cuda") else None

    def _send(self, batch: Any) -> Tuple[torch.Tensor, Any]:
        host = self.get(batch)
        if self.stream is None:
            return host, None
        with torch.cuda.stream(self.stream):
            on_device = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return on_device, event

    def __iter__(self) -> Iterator[torch.Tensor]:
        it = iter(self.batches)
        ahead = next(it, None)
        pending = self._send(ahead) if ahead is not None else None
        while pending is not None:
            x, event = pending
            ahead = next(it, None)
            pending = self._send(ahead) if ahead is not None else None
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
                x.record_stream(torch.cuda.current_stream())
            yield x


def small_net(classes: int = 100) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(128, 256, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, classes))


def train_loop(loader: Iterable[Any], device: str, *, side: int, steps: int, warmup: int,
               get: Callable[[Any], torch.Tensor]) -> Dict[str, Any]:
    """Step time and the GPU's busy fraction (compute time between events on the training
    stream / wall time) over ``steps`` steps after ``warmup``; on the CPU, compute wall time."""
    torch.manual_seed(0)
    model = small_net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = device.startswith("cuda")
    busy: List[Any] = []
    start = None
    done = 0
    for i, x in enumerate(DevicePrefetch(loader, device, get)):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        began = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            began.record()
        images = x[:, :3 * side * side].reshape(-1, 3, side, side).float().div_(255)
        loss = torch.nn.functional.cross_entropy(model(images),
                                                 x[:, 0].long() % 100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            if cuda:
                ended = torch.cuda.Event(enable_timing=True)
                ended.record()
                busy.append((began, ended))
            else:
                busy.append(time.perf_counter() - began)
            done += 1
        if done >= steps:
            break
    sync(device)
    if start is None or not done:
        return {"steps": 0, "error": "the loader ran out during warm-up"}
    wall = time.perf_counter() - start
    compute = sum(a.elapsed_time(b) / 1e3 for a, b in busy) if cuda else sum(busy)
    return {"steps": done, "wall_s": wall, "step_s": wall / done,
            "busy_fraction": min(1.0, compute / wall)}


def first_tensor(key: str) -> Callable[[Any], torch.Tensor]:
    """The batch's ``key`` field as a [B, L] uint8 tensor (both loaders stack equal lengths)."""
    def get(batch: Any) -> torch.Tensor:
        value = batch[key]
        return value if isinstance(value, torch.Tensor) else torch.stack(list(value))
    return get
