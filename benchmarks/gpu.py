"""The GPU path, on a GPU (issue 35): one script for a short lent device session.

    python benchmarks/gpu.py --out "$OUT" --budget-s 300

Checks the environment (CUDA, the card, kvikio/libcufile for GPUDirect Storage), runs the CUDA
tests, then measures, every comparison in the same run on the same card:
  checkpoint  save() stall of CUDA state vs torch.save and DCP async_save; D2H rate during the
              snapshot vs the card's pinned copy rate (sizes 2, 8, 16 GiB, as card, host, disk
              and the time budget allow)
  load        load_checkpoint(map_location="cuda") vs torch.load and safetensors, cold
  loop        a small conv net on uint8 batches: flashstream tensors(B) vs webdataset's chain,
              same DataLoader settings (pin_memory=True), transfer overlapped with compute
Writes ``OUT/gpu.json`` after every part (a timeout still leaves what was measured) and prints
the targets' verdicts. Without CUDA it writes a JSON that says so and which parts it would run,
and exits 0; ``--device cpu`` runs the parts on the CPU at tiny sizes, as a smoke test (those
figures are not GPU figures, and nothing is judged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gpu_measure as measure  # noqa: E402

from flashstream.sizes import parse_size  # noqa: E402
from flashstream.telemetry.gpu import gpu_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "checkpoint", "load", "loop")
GiB = 1 << 30
#: The CUDA tests: the tests of these modules whose names say cuda, pinned, pin_memory or
#: map_location (the last two also run without a GPU, and check more with one).
CUDA_TESTS = ("tests/test_device_copy.py", "tests/test_device_loads.py",
              "tests/test_checkpoint.py", "tests/test_tensors.py")
CUDA_TEST_FILTER = "cuda or pinned or pin_memory or map_location"
#: (key, ">=" or "<=", bound, what it compares) - issue 35's targets, ratios within one run.
TARGETS = [
    ("stall_vs_torch_save", "<=", 1 / 20,
     "CheckpointWriter.save stall / torch.save time, same CUDA state"),
    ("d2h_vs_pinned", ">=", 0.8,
     "D2H rate during the snapshot / the card's pinned copy rate"),
    ("load_speedup_vs_torch_load", ">=", 1.5,
     "torch.load(map_location=cuda) time / load_checkpoint(map_location=cuda) time"),
    ("busy_vs_webdataset", ">=", 1.0,
     "GPU busy fraction, flashstream / webdataset, same loader"),
    ("step_time_vs_webdataset", "<=", 1.0,
     "step time, flashstream / webdataset, same loader"),
]
# Rough seconds per GiB of state for one size's checkpoint and load parts (two saves, a
# torch.save, DCP, three cold loads): only to keep sizes inside the budget.
_SECONDS_PER_GIB = 10.0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    p.add_argument("--workdir", type=Path, default=None,
                   help="where checkpoints and shards go (not --out: they are large); "
                        "default a temporary directory, removed at the end")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--sizes", default="2GiB,8GiB,16GiB", help="checkpoint sizes to try")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--windows", default="4MiBx32,8MiBx16,16MiBx16",
                   help="read windows (chunk x requests in flight) to load and read with "
                        "besides the loader's own; '' for none")
    p.add_argument("--device", default=None, help="default cuda; cpu = smoke run, not judged")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--side", type=int, default=64, help="images are 3 x side x side uint8")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args(argv)
    args.sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",") if s]
    args.parts = [s for s in args.parts.split(",") if s]
    try:
        args.windows = [parse_window(w) for w in args.windows.split(",") if w]
    except ValueError as err:
        p.error(str(err))
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; allowed {list(PARTS)}")
    return args


def parse_window(text: str) -> Tuple[int, int]:
    """"16MiBx16" -> (16 MiB, 16)."""
    chunk, sep, depth = text.rpartition("x")
    if not sep or not depth.isdigit() or int(depth) < 1:
        raise ValueError(f"--windows: {text!r} is not CHUNKxDEPTH, such as 16MiBx16")
    return parse_size(chunk, name="--windows"), int(depth)


def plan_sizes(wanted: Sequence[int], *, card_bytes: int, host_bytes: int, disk_bytes: int,
               budget_s: float) -> Tuple[List[int], Dict[str, str]]:
    """The sizes that fit: state + a loaded copy on the card (under 40% of it each), pinned
    staging + torch.save's host copy (under 30% of host memory), three files at once on disk,
    and the running total of their rough time inside 60% of the budget."""
    kept: List[int] = []
    dropped: Dict[str, str] = {}
    spent = 0.0
    for size in sorted(wanted):
        seconds = _SECONDS_PER_GIB * size / GiB
        why = ("card memory" if size > 0.4 * card_bytes else
               "host memory" if size > 0.3 * host_bytes else
               "disk" if 3 * size > 0.8 * disk_bytes else
               "time budget" if spent + seconds > 0.6 * budget_s else None)
        if why:
            dropped[str(size)] = why
        else:
            kept.append(size)
            spent += seconds
    return kept, dropped


def ratios(results: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The targets' values from one run's results (None where a part did not measure)."""
    out: Dict[str, Optional[float]] = {k: None for k, *_ in TARGETS}
    sizes = results.get("checkpoint", {}).get("sizes", {})
    largest = sizes[max(sizes, key=int)] if sizes else {}
    ours = largest.get("flashstream", {})
    pinned = results.get("checkpoint", {}).get("pinned_copy", {}).get("gbps")
    if ours.get("stall_s") and largest.get("torch_save", {}).get("seconds"):
        out["stall_vs_torch_save"] = ours["stall_s"] / largest["torch_save"]["seconds"]
    if ours.get("d2h_gbps") and pinned:
        out["d2h_vs_pinned"] = ours["d2h_gbps"] / pinned
    load = results.get("load", {})
    if load.get("flashstream", {}).get("seconds") and load.get("torch_load", {}).get("seconds"):
        out["load_speedup_vs_torch_load"] = (load["torch_load"]["seconds"]
                                             / load["flashstream"]["seconds"])
    ours, theirs = results.get("loop", {}).get("flashstream", {}), \
        results.get("loop", {}).get("webdataset", {})
    if ours.get("busy_fraction") and theirs.get("busy_fraction"):
        out["busy_vs_webdataset"] = ours["busy_fraction"] / theirs["busy_fraction"]
    if ours.get("step_s") and theirs.get("step_s"):
        out["step_time_vs_webdataset"] = ours["step_s"] / theirs["step_s"]
    return out


def verdicts(results: Dict[str, Any], *, judged: bool) -> Dict[str, Dict[str, Any]]:
    """label -> value, target, met (None where not measured or not judged: a CPU smoke run)."""
    values = ratios(results)
    out = {}
    for key, op, bound, label in TARGETS:
        value = values[key]
        met = None if value is None or not judged else \
            (value >= bound if op == ">=" else value <= bound)
        out[label] = {"key": key, "value": value, "target": f"{op} {bound:.3g}", "met": met}
    return out


def print_verdicts(table: Dict[str, Dict[str, Any]]) -> None:
    for label, v in table.items():
        mark = {True: "met    ", False: "NOT met", None: "not judged"}[v["met"]]
        value = "not measured" if v["value"] is None else f"{v['value']:.3f}"
        print(f"  {mark}  {label}: {value} (target {v['target']})")


class Results:
    """The run's JSON, rewritten after every part so a timeout leaves what was measured."""

    def __init__(self, path: Path, payload: Dict[str, Any]) -> None:
        self.path, self.payload = path, payload
        self.write()

    def set(self, key: str, value: Any) -> None:
        self.payload[key] = value
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.payload, indent=2, default=str))
        os.replace(tmp, self.path)


def run_cuda_tests(out: Path, timeout_s: float) -> Dict[str, Any]:
    """pytest on the CUDA tests; counts and the failing tests' names from its JUnit XML."""
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS,
           "-k", CUDA_TEST_FILTER, f"--junitxml={xml}"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    result = junit_summary(xml) if xml.exists() else {}
    result.update(returncode=done.returncode, tail=(done.stdout + done.stderr)[-2000:])
    return result


def junit_summary(xml: Path) -> Dict[str, Any]:
    cases = ET.parse(xml).getroot().iter("testcase")
    passed, failed, skipped = [], [], []
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    return {"passed": len(passed), "failed": failed, "skipped": len(skipped)}


def environment(device: str) -> Dict[str, Any]:
    info = gpu_info()
    info.update(device=device, torch=torch.__version__, python=sys.version.split()[0],
                host_memory_bytes=psutil.virtual_memory().total, cpus=os.cpu_count())
    return info


def part_checkpoint(args, results: Results, workdir: Path, device: str, deadline: float) -> None:
    card = (torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda")
            else psutil.virtual_memory().total)
    sizes, dropped = plan_sizes(args.sizes, card_bytes=card,
                                host_bytes=psutil.virtual_memory().total,
                                disk_bytes=shutil.disk_usage(workdir).free,
                                budget_s=deadline - time.monotonic())
    part: Dict[str, Any] = {"planned": sizes, "dropped": dropped, "sizes": {}}
    # The card's rate at the size of the largest state it copies (1 GiB at most: long enough).
    part["pinned_copy"] = measure.copy_rate(min(max(sizes, default=1 << 20), GiB), device)
    results.set("checkpoint", part)
    for size in sizes:
        if time.monotonic() > deadline:
            part["dropped"][str(size)] = "ran out of time"
            break
        state = measure.make_state(size, device)
        where = workdir / f"ckpt-{size}"
        got = measure.save_stall(state, where, device)
        del state
        part["sizes"][str(size)] = got
        part["load_from"] = {"file": got.pop("file"), "pt_file": got.pop("pt_file")}
        results.set("checkpoint", part)
        if size != sizes[-1]:
            shutil.rmtree(where, ignore_errors=True)


def part_load(args, results: Results, device: str) -> None:
    files = results.payload.get("checkpoint", {}).get("load_from")
    if not files:
        results.set("load", {"error": "no checkpoint was written (the checkpoint part did not "
                                      "run)"})
        return
    load = measure.loads(files["file"], files["pt_file"], device, args.windows)
    results.set("load", load)
    # The limit the loads are judged against: the drive's own cold read rates.
    load["drive"] = measure.read_rates(files["file"], [measure.READ_WINDOWS[0], *args.windows])
    results.set("load", load)


def part_loop(args, results: Results, workdir: Path, device: str) -> None:
    import _bench
    import _loaders
    from torch.utils.data import DataLoader

    sample = 3 * args.side * args.side
    data = workdir / "shards"
    data.mkdir(exist_ok=True)
    # Twice the samples the steps take (write_synthetic_shards counts 1536 bytes of tar
    # headers and label per sample).
    total = (sample + 1536) * args.batch_size * (args.steps + args.warmup + 2) * 2
    paths = _bench.write_synthetic_shards(data, sample_size=sample, total_bytes=total,
                                          shard_bytes=64 << 20)
    loop: Dict[str, Any] = {"batch_size": args.batch_size, "workers": args.workers,
                            "pin_memory": device.startswith("cuda")}
    for name in ("flashstream", "webdataset"):
        setup = argparse.Namespace(batch_size=args.batch_size, workers=args.workers,
                                   persistent_workers=False, engine=None, chunk_size=None,
                                   queue_depth=None)
        made = _loaders.make_loader("tensors" if name == "flashstream" else name, paths, setup)
        loader = DataLoader(made.items.dataset, batch_size=None, num_workers=args.workers,
                            pin_memory=loop["pin_memory"])
        loop[name] = measure.train_loop(loader, device, side=args.side, steps=args.steps,
                                        warmup=args.warmup, get=measure.first_tensor("bin"))
        results.set("loop", loop)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    device = args.device or "cuda"
    gpu = device.startswith("cuda")
    results = Results(args.out / "gpu.json", {"environment": environment(device),
                                              "parts": args.parts, "smoke": not gpu})
    print("flashstream gpu benchmark — " + json.dumps(results.payload["environment"]))
    if gpu and not torch.cuda.is_available():
        results.set("skipped", "no GPU: torch.cuda.is_available() is False; would run "
                               + ", ".join(args.parts))
        print(results.payload["skipped"])
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="flashstream-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        for part in args.parts:
            if time.monotonic() > deadline:
                results.set(part, {"error": "not run: the budget was spent"})
                continue
            print(f"-- {part} ({deadline - time.monotonic():.0f} s left)", flush=True)
            try:
                if part == "tests":
                    results.set("tests", run_cuda_tests(args.out, min(180.0, args.budget_s)))
                elif part == "checkpoint":
                    part_checkpoint(args, results, workdir, device, deadline)
                elif part == "load":
                    part_load(args, results, device)
                elif part == "loop":
                    part_loop(args, results, workdir, device)
            except Exception as err:  # noqa: BLE001 - the other parts still run
                results.set(f"{part}_error", f"{type(err).__name__}: {err}")
                print(f"   {part} failed: {err}", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    table = verdicts(results.payload, judged=gpu)
    results.set("verdicts", table)
    results.set("seconds", time.monotonic() - start)
    print("targets" + ("" if gpu else " (CPU smoke run: not GPU figures, nothing judged)"))
    print_verdicts(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
