"""What checkpoint.py reports of its runs (_checkpoint_runs.py): each writer's ratios to fio,
to torch.save's stall and of the reader's idle p95, the table with each CheckpointWriter's last
SaveReport, and the targets."""

from __future__ import annotations

import statistics
from typing import Dict, Optional

import _bench

__all__ = ["OURS", "check_targets", "ratios", "table"]

OURS = ("unpaced", "fixed", "auto", "copy")  # CheckpointWriter rows ("copy": unpaced, copy)
STALL_SHARE = 1 / 20     # CheckpointWriter's stall at most this share of torch.save's
MANY_SMALL_SHARE = 1 / 10  # the same with --many-small (50,000 tensors of 1 KB)
FIRST_SHARE = 1 / 5      # the first save's stall (1/20 too with --reserve)
FIO_SHARE = 0.85         # unpaced CheckpointWriter's GB/s at least this share of fio's
RATE_TOLERANCE = 0.05    # a paced write's achieved rate within this of the target


# -- figures and targets ------------------------------------------------------------------------
def ratios(out: Dict[str, object], idle: Optional[Dict[str, object]]) -> None:
    """Add each writer's ratio to fio, to torch.save's stall and of the reader's p95."""
    fio = out["fio"]["gbps"]
    torch_stall = out["writers"].get("torch.save", {}).get("stall_s")
    for result in out["writers"].values():
        if "error" in result:
            continue
        result["gbps_vs_fio"] = result["gbps"] / fio if fio else None
        result["stall_vs_torch_save"] = (result["stall_s"] / torch_stall
                                         if torch_stall else None)
        result["stall_first_vs_torch_save"] = (result["stall_first_s"] / torch_stall
                                               if torch_stall else None)
        beside = result.get("reader")
        if beside and idle and idle.get("p95_us") and beside.get("p95_us"):
            beside["p95_vs_idle"] = beside["p95_us"] / idle["p95_us"]


def table(out: Dict[str, object]) -> None:
    rows = []
    for name, r in out["writers"].items():
        if "error" in r:
            rows.append({"writer": r.get("label", name), "stall first ms": r["error"][:60]})
            continue
        row = {"writer": r["label"], "stall first ms": r["stall_first_s"] * 1e3,
               "stall ms": r["stall_s"] * 1e3, "vs torch.save": _share(r["stall_vs_torch_save"]),
               "next step +ms": r["step_overhead_s"] * 1e3,
               "write GB/s": r["gbps"], "vs fio": r["gbps_vs_fio"],
               "rate accuracy": r.get("rate_accuracy"),
               "reader p95 ms": _get(r, "reader", "p95_us", scale=1e-3),
               "p95 vs idle": _get(r, "reader", "p95_vs_idle")}
        rows.append(row)
        if name == "torch.save":
            rows.append({**row, "writer": "torch.save + fsync",
                         "stall first ms": r["saves"][0]["durable_stall_s"] * 1e3,
                         "stall ms": r["durable_stall_s"] * 1e3, "vs torch.save": None,
                         "next step +ms": None,
                         "reader p95 ms": None, "p95 vs idle": None})
    columns = ["writer", "stall first ms", "stall ms", "vs torch.save", "next step +ms",
               "write GB/s", "vs fio",
               "rate accuracy", "reader p95 ms", "p95 vs idle"]
    if not any(r.get("reader p95 ms") for r in rows):
        columns = columns[:-2]
    print()
    _bench.print_table(rows, columns)
    fio = out["fio"]
    if fio["gbps"]:
        runs = " and ".join(f"{fio[k]['gbps']:.3f}" for k in ("before", "after") if fio.get(k))
        over = [fio[k]["overwrite"]["gbps"] for k in ("before", "after")
                if fio.get(k) and fio[k].get("overwrite")]
        print(f"  fio sequential write (8 MiB x 8, O_DIRECT, end_fsync) into a new file, as a "
              f"checkpoint is written: {fio['gbps']:.3f} GB/s (mean of {runs}); overwriting "
              f"that file: {statistics.mean(over) if over else float('nan'):.3f} GB/s")
    auto = out["writers"].get("auto", {})
    if "peak_rate" in auto:
        print(f"  auto: peak {auto['peak_rate'] / 1e9:.3f} GB/s, " + (
            f"cliff seen: sustained {auto['sustained_rate'] / 1e9:.3f} GB/s, paced at "
            f"{auto['final_rate'] / 1e9:.3f} GB/s" if auto["cliff"] else "no cliff seen"))
    for name in OURS:
        saves = out["writers"].get(name, {}).get("saves")
        if saves:
            print(f"\nCheckpointWriter {name}, last save, SaveReport:")
            print("  " + saves[-1]["report_table"].replace("\n", "\n  "))


def _share(value: Optional[float]) -> Optional[str]:
    if value is None:
        return None
    return f"1/{1 / value:,.1f}" if value < 0.5 else f"{value:.2f}x"


def _get(result: Dict[str, object], *keys: str, scale: float = 1.0) -> Optional[float]:
    for key in keys:
        result = (result or {}).get(key)
    return None if result is None else result * scale


def check_targets(out: Dict[str, object], args) -> Dict[str, object]:
    writers = out["writers"]
    ours = {k: v for k, v in writers.items() if k in OURS[:3] and "error" not in v}
    verdicts: Dict[str, object] = {}
    stalls = [v["stall_vs_torch_save"] for v in ours.values()
              if v.get("stall_vs_torch_save") is not None]
    share = MANY_SMALL_SHARE if args.many_small else STALL_SHARE
    if stalls:
        # OURS[:3]: the copy row is a comparison with snapshot="copy", not a target.
        verdicts["CheckpointWriter stall / torch.save blocking time (worst of unpaced, fixed, "
                 "auto)"] = {
            "value": max(stalls), "target": f"<= {share:.2f}", "met": max(stalls) <= share}
    firsts = [v["stall_first_vs_torch_save"] for v in ours.values()
              if v.get("stall_first_vs_torch_save") is not None]
    if firsts:
        first = share if args.reserve else FIRST_SHARE
        verdicts["CheckpointWriter first save's stall / torch.save's (worst of unpaced, "
                 "fixed, auto)"] = {
            "value": max(firsts), "target": f"<= {first:.2f}", "met": max(firsts) <= first}
    unpaced = ours.get("unpaced", {}).get("gbps_vs_fio")
    if unpaced is not None:
        verdicts["unpaced CheckpointWriter GB/s / fio sequential write GB/s"] = {
            "value": unpaced, "target": f">= {FIO_SHARE}", "met": unpaced >= FIO_SHARE}
    accuracy = ours.get("fixed", {}).get("rate_accuracy")
    if accuracy is not None:
        verdicts["paced CheckpointWriter achieved rate / target rate"] = {
            "value": accuracy, "target": f"1 +- {RATE_TOLERANCE}",
            "met": abs(accuracy - 1) <= RATE_TOLERANCE}
    if verdicts:
        print("\ntargets:")
        _bench.print_verdicts(verdicts)
    return verdicts
