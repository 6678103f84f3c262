"""What benchmarks/epoch.py judges, and how: ratios within a round, targets, context.

Speed is judged against the drive (a loader the drive holds back cannot go faster, whatever
webdataset does on the same machine) and CPU against what a GB delivered costs. webdataset's
speed ratios are printed beside the verdicts as context: its chain is held by the CPU, so how
many times faster an accelerated path is grows with the drive's speed.
"""

from __future__ import annotations

from typing import Dict, Optional

import _bench

__all__ = ["CONTEXT", "JPEG", "MAX_RESIDENCY", "RATIOS", "TARGETS", "check_targets", "context",
           "median_value", "ratios"]

JPEG = "jpeg"  # the profile of small JPEGs, read by the decode chains

# Targets, each (profile, value, ">=" or "<=", bound, what it compares). A value is a ratio
# (RATIOS) or a loader's "loader.figure", as medians over the rounds. They are set for the
# defaults (2 workers, batch 256).
TARGETS = [
    ("100KB", "inprocess.gbps_vs_drive", ">=", 0.9,
     "ShardStream in process / the drive (fio, else the probe), GB/s"),
    ("100KB", "tensors.gbps_vs_drive", ">=", 0.85,
     "tensors(B) through DataLoader workers / the drive (fio, else the probe), GB/s"),
    ("100KB", "tensors_vs_inprocess", ">=", 0.85,
     "tensors(B) through DataLoader workers / ShardStream in process, samples/s"),
    ("100KB", "tensors.cpu_s_per_gb", "<=", 0.3,
     "tensors(B) core-seconds per GB delivered (this process and the workers)"),
    ("100KB", "tensors_cpu_vs_webdataset", "<=", 0.2,
     "tensors(B) / webdataset .map(to_tensor).batched(B), core-seconds per GB"),
    ("8KB", "tensors_cpu_vs_webdataset", "<=", 0.2,
     "tensors(B) / webdataset .map(to_tensor).batched(B), core-seconds per GB"),
    (JPEG, "decode_vs_webdataset", ">=", 1.0,
     "flashstream decode chain / webdataset decode chain, same loader, samples/s"),
    (JPEG, "decode_cpu_vs_webdataset", "<=", 1.0,
     "flashstream decode chain / webdataset decode chain, core-seconds per GB"),
]
# Printed beside the verdicts, never judged: webdataset's chain is held by the CPU, so how many
# times faster the accelerated paths are grows with the drive (and shrinks on a slow one).
CONTEXT = ("tensors_vs_webdataset", "inprocess_vs_webdataset", "webdataset.gbps_vs_drive",
           "webdataset.cpu_s_per_gb")
MAX_RESIDENCY = 0.01  # page cache share of the shards after a cold flashstream epoch
RATIOS = {  # name -> (numerator, denominator, field)
    "tensors_vs_inprocess": ("tensors", "inprocess", "samples_per_s"),
    "tensors_vs_webdataset": ("tensors", "webdataset", "samples_per_s"),
    "inprocess_vs_webdataset": ("inprocess", "webdataset", "samples_per_s"),
    "inprocess_vs_fio": ("inprocess", "fio", "gbps"),
    "tensors_vs_fio": ("tensors", "fio", "gbps"),
    "decode_vs_webdataset": ("decode_flashstream", "decode_webdataset", "samples_per_s"),
    "tensors_cpu_vs_webdataset": ("tensors", "webdataset", "cpu_s_per_gb"),
    "decode_cpu_vs_webdataset": ("decode_flashstream", "decode_webdataset", "cpu_s_per_gb"),
}


def ratios(run: Dict[str, object]) -> Dict[str, Optional[float]]:
    """The RATIOS of one round, between loaders measured minutes apart at most."""
    out: Dict[str, Optional[float]] = {}
    for name, (top, bottom, field) in RATIOS.items():
        a, b = run.get(top) or {}, run.get(bottom) or {}
        if a.get(field) and b.get(field):
            out[name] = a[field] / b[field]
    return out


def median_value(result: Dict[str, object], key: str) -> Optional[float]:
    """A ratio (``tensors_vs_inprocess``) or a loader's figure (``tensors.cpu_s_per_gb``),
    median over the rounds."""
    median = result.get("median", {})
    if "." in key:
        loader, field = key.split(".")
        return (median.get(loader) or {}).get(field)
    return median.get(key)


def check_targets(results: Dict[str, Dict[str, object]]) -> Dict[str, object]:
    """label -> value, target and whether it was met, for every target a run measured (and the
    page cache after flashstream's cold epochs); printed."""
    verdicts: Dict[str, object] = {}
    for profile, key, op, bound, label in TARGETS:
        value = median_value(results.get(profile, {}), key)
        if value is not None:
            met = value >= bound if op == ">=" else value <= bound
            verdicts[f"{profile}: {label}"] = {"value": value, "target": f"{op} {bound}",
                                               "met": met}
    for profile, result in results.items():
        shares = [f["residency"] for f in result["median"].values()
                  if isinstance(f, dict) and f.get("residency") is not None]
        if shares:
            worst = max(shares)
            verdicts[f"{profile}: page cache after cold flashstream epochs"] = {
                "value": worst, "target": f"< {MAX_RESIDENCY}", "met": worst < MAX_RESIDENCY}
    if verdicts:
        print("\ntargets (medians over rounds; ratios taken within a round):")
        _bench.print_verdicts(verdicts)
    return verdicts


def context(results: Dict[str, Dict[str, object]]) -> Dict[str, Dict[str, float]]:
    """The figures printed beside the verdicts and never judged (see CONTEXT)."""
    out = {profile: {key: value for key in CONTEXT
                     if (value := median_value(result, key)) is not None}
           for profile, result in results.items()}
    out = {profile: figures for profile, figures in out.items() if figures}
    if out:
        print("\ncontext, not targets (webdataset's chain is held by the CPU, so these grow "
              "with the drive's speed):")
        for profile, figures in out.items():
            print(f"  {profile}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    return out
