"""What this machine offers the GPU path: CUDA, the cards, and GPUDirect Storage (GDS).

flashstream reads and writes through host memory: shards and checkpoints are read into host
buffers (pinned where a device copy follows) and copied to the device, and snapshots of CUDA
state go through pinned staging. It has no GDS path (reads straight from the drive into device
memory) yet; ``gpu_info`` says whether one could be built here (kvikio importable, libcufile
present, kvikio not in compatibility mode), and that it is not used, so a report never implies
device-direct reads that did not happen.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
from typing import Any, Dict, List, Optional

import torch

__all__ = ["gds_info", "gpu_info"]

#: Why the GDS fields say "used: False" whatever is installed.
NO_GDS_PATH = "flashstream has no GPUDirect Storage path yet: reads go through host memory"


def gpu_info() -> Dict[str, Any]:
    """CUDA as torch sees it, the cards, and ``gds_info()``. Cheap; safe without a GPU."""
    available = torch.cuda.is_available()
    cards: List[Dict[str, Any]] = []
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            cards.append({"index": index, "name": props.name,
                          "memory_bytes": int(props.total_memory),
                          "capability": f"{props.major}.{props.minor}"})
    return {"cuda_available": available, "torch_cuda": torch.version.cuda, "cards": cards,
            "gds": gds_info()}


def gds_info() -> Dict[str, Any]:
    """Whether GPUDirect Storage could work here, from what is installed; never used."""
    kvikio = _kvikio()
    library = ctypes.util.find_library("cufile")
    return {"kvikio": kvikio.get("version"), "kvikio_compat_mode": kvikio.get("compat_mode"),
            "gds_available": kvikio.get("gds_available"), "libcufile": library,
            "used": False, "why": NO_GDS_PATH}


def _kvikio() -> Dict[str, Optional[Any]]:
    """kvikio's version and its own view of GDS (compatibility mode means POSIX reads), or
    Nones where it is not installed or cannot say (no driver, no GPU)."""
    if importlib.util.find_spec("kvikio") is None:
        return {}
    try:
        import kvikio
        import kvikio.defaults
    except Exception as err:  # noqa: BLE001 - an unusable install is reported, not raised
        return {"version": f"import failed: {err}"}
    out: Dict[str, Optional[Any]] = {"version": getattr(kvikio, "__version__", "unknown")}
    try:
        out["compat_mode"] = str(kvikio.defaults.compat_mode())
    except Exception as err:  # noqa: BLE001
        out["compat_mode"] = f"unknown: {err}"
    try:
        out["gds_available"] = bool(kvikio.DriverProperties().is_gds_available)
    except Exception as err:  # noqa: BLE001
        out["gds_available"] = f"unknown: {err}"
    return out
