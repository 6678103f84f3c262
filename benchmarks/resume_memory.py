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
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import psutil
import torch

from flashstream import CheckpointWriter, load_checkpoint
from flashstream.cache import evict
from flashstream.sizes import format_size, parse_size

WAYS = ("torch.load", "flashstream", "flashstream-into")
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    results: Dict[str, Dict[str, float]] = {}
    for way in WAYS:
        evict([directory for directory in args.dir.rglob("*") if directory.is_file()])
        out = subprocess.run([sys.executable, __file__, "--child", way, "--size", str(size),
                              "--dir", str(args.dir)], check=True, capture_output=True,
                             text=True)
        results[way] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["torch.load"]
    print(f"\ncheckpoint {format_size(nbytes)}; each way in a fresh process: build model + "
          f"AdamW, load, one step")
    print(f"{'way':18} {'peak RSS':>10} {'x torch':>8} {'peak in load':>13} {'x torch':>8} "
          f"{'RSS after step':>15} {'x torch':>8} {'load s (cold)':>14}")
    for way, r in results.items():
        r["peak_vs_torch_load"] = r["peak_rss"] / base["peak_rss"]
        r["load_peak_vs_torch_load"] = r["load_peak_rss"] / base["load_peak_rss"]
        r["after_vs_torch_load"] = r["rss_after_step"] / base["rss_after_step"]
        print(f"{way:18} {format_size(r['peak_rss']):>10} {r['peak_vs_torch_load']:>8.3f} "
              f"{format_size(r['load_peak_rss']):>13} {r['load_peak_vs_torch_load']:>8.3f} "
              f"{format_size(r['rss_after_step']):>15} {r['after_vs_torch_load']:>8.3f} "
              f"{r['load_s']:>14.2f}")
    worst = max(results[w]["peak_vs_torch_load"] for w in WAYS[1:])
    print(f"\ntarget: peak RSS <= 1.05 x torch.load's: {'met' if worst <= 1.05 else 'NOT met'} "
          f"(worst {worst:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"size": size, "checkpoint_bytes": nbytes,
                                         "results": results, "target_met": worst <= 1.05},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
