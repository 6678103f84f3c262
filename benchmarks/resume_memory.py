"""Peak memory of a resume: load a model + AdamW checkpoint, then train one step.

Each way of resuming runs in a fresh process (peak RSS is per process), as a training job
does: build the model and the optimizer, load the checkpoint, run one AdamW step. Measured:
peak RSS (VmHWM) and RSS after the step (after ``malloc_trim``: the memory still in
use), against ``torch.load`` of the same state saved with ``torch.save``.

    python benchmarks/resume_memory.py                  # 768 MiB of parameters
    python benchmarks/resume_memory.py --size 256MiB --json out.json

Ways: ``torch.load`` (+ ``load_state_dict``), ``flashstream`` (``load_checkpoint`` +
``load_state_dict``), ``flashstream-into`` (``load_checkpoint(into=...)``, which reads the
parameters in place). Target (issue 14): peak RSS at most 1.05 x torch.load's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import psutil
import torch

from flashstream import CheckpointWriter, load_checkpoint
from flashstream.pagecache import evict
from flashstream.sizes import format_size, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

WAYS = ("torch.load", "flashstream", "flashstream-into")
PEAK_SHARE = 1.05  # issue 14: peak RSS at most this x torch.load's
_WIDTH = 2048  # a Linear(2048, 2048) holds 16 MiB of float32 weights


def build(size: int, seed: int = 0):
    torch.manual_seed(seed)
    layers = max(1, size // (_WIDTH * _WIDTH * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH, bias=False)
                                  for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model, optimizer) -> None:
    model(torch.randn(4, _WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process image's peak RSS (VmHWM). Not ru_maxrss: Linux carries that over from
    the parent across fork + exec, so every child would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this benchmark needs Linux")


def live_rss() -> int:
    """RSS once glibc has handed freed heap memory back (malloc_trim): what is still in use,
    not what the allocator happens to keep after frees of a given order."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def child(way: str, size: int, directory: Path) -> Dict[str, float]:
    model, optimizer = build(size, seed=1)
    built = rss()
    started = time.perf_counter()
    if way == "torch.load":
        state = torch.load(directory / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    elif way == "flashstream":
        state = load_checkpoint(directory / "flashstream")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    else:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        load_checkpoint(directory / "flashstream", into=state)
        optimizer.load_state_dict(state["optim"])
    del state
    load_s = time.perf_counter() - started
    load_peak = peak_rss()
    train_step(model, optimizer)
    return {"built_rss": built, "rss_after_step": live_rss(), "load_s": load_s,
            "load_peak_rss": load_peak,
            "peak_rss": peak_rss()}


def prepare(size: int, directory: Path) -> int:
    model, optimizer = build(size)
    train_step(model, optimizer)  # AdamW's moments exist from the first step
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    torch.save(state, directory / "state.pt")
    with CheckpointWriter(directory / "flashstream", keep=1) as writer:
        report = writer.save(state, step=1).result()
    return report.bytes


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="768MiB", help="parameter bytes (default 768MiB)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/resume-memory"))
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = parse_size(args.size, name="--size")
    if args.child:
        print(json.dumps(child(args.child, size, args.dir)))
        return 0
    print(f"saving a {format_size(size)} model + AdamW state (torch.save and flashstream)...")
    nbytes = prepare(size, args.dir)
    info = _bench.environment(args.dir)
    _bench.print_header(info)
    files = [path for path in args.dir.rglob("*") if path.is_file()]
    results: Dict[str, Dict[str, float]] = {}
    for way in WAYS:
        evict(files)
        out = subprocess.run([sys.executable, __file__, "--child", way, "--size", str(size),
                              "--dir", str(args.dir)], check=True, capture_output=True,
                             text=True)
        results[way] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["torch.load"]
    rows = []
    for way, r in results.items():
        for key in ("peak_rss", "load_peak_rss", "rss_after_step"):
            r[f"{key}_vs_torch_load"] = r[key] / base[key]
        rows.append({"way": way, "peak RSS": format_size(r["peak_rss"]),
                     "x torch": r["peak_rss_vs_torch_load"],
                     "peak in load": format_size(r["load_peak_rss"]),
                     "x torch ": r["load_peak_rss_vs_torch_load"],
                     "RSS after step": format_size(r["rss_after_step"]),
                     "x torch  ": r["rss_after_step_vs_torch_load"],
                     "load s (cold)": r["load_s"]})
    print(f"\ncheckpoint {format_size(nbytes)}; each way in a fresh process: build model + "
          f"AdamW, load, one step")
    _bench.print_table(rows, list(rows[0]))
    worst = max(results[w]["peak_rss_vs_torch_load"] for w in WAYS[1:])
    verdicts = {"peak RSS of a resume / torch.load's (worst way)": {
        "value": worst, "target": f"<= {PEAK_SHARE}", "met": worst <= PEAK_SHARE}}
    print("\ntargets:")
    _bench.print_verdicts(verdicts)
    if args.json:
        payload = {"environment": info, "size": size, "checkpoint_bytes": nbytes,
                   "results": results, "verdicts": verdicts}
        print(f"\nJSON: {_bench.write_json(args.json, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
