"""A drive's health from ``nvme smart-log`` (nvme-cli): wear, bytes written, temperature.

Every failure (not an NVMe device, nvme-cli missing, not permitted, too slow, not JSON) gives a
"not available" dict with the reason, never an error: health is shown beside the device
(telemetry/device.py), never needed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any, Dict, Optional

__all__ = ["NVME_TIMEOUT_S", "not_available", "nvme_health"]

NVME_TIMEOUT_S = 5.0
# nvme-cli's "data unit" is 1000 blocks of 512 bytes (NVMe spec, SMART log page).
_DATA_UNIT_BYTES = 512_000


def not_available(reason: str) -> Dict[str, Any]:
    return {"status": "not available", "reason": reason}


def nvme_health(name: str) -> Dict[str, Any]:
    """SMART figures from ``nvme smart-log``; a "not available" dict for any failure."""
    if not name.startswith("nvme"):
        return not_available(f"{name} is not an NVMe device")
    nvme = shutil.which("nvme")
    if nvme is None:
        return not_available("nvme-cli is not installed (no 'nvme' on PATH)")
    node = f"/dev/{name}"
    try:
        run = subprocess.run([nvme, "smart-log", node, "-o", "json"], capture_output=True,
                             text=True, timeout=NVME_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return not_available(f"nvme smart-log {node} took longer than {NVME_TIMEOUT_S:g} s")
    except OSError as exc:
        return not_available(f"cannot run {nvme}: {exc}")
    if run.returncode != 0:
        detail = (run.stderr.strip().splitlines() or ["no message"])[-1]
        return not_available(f"nvme smart-log {node} exited {run.returncode}: {detail}")
    try:
        log = json.loads(run.stdout)
    except ValueError:
        log = None
    if not isinstance(log, dict):
        return not_available(f"nvme smart-log {node} did not print a JSON object")
    return _health_fields(log, node)


def _as_int(value: Any) -> Optional[int]:
    """nvme-cli prints counters as numbers, 128-bit ones as strings, and (2.x) some as objects."""
    if isinstance(value, dict):
        value = value.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        return int(str(value).replace(",", "").strip())
    except ValueError:
        return None


def _health_fields(log: Dict[str, Any], node: str) -> Dict[str, Any]:
    used = _as_int(log.get("percent_used", log.get("percentage_used")))
    units = _as_int(log.get("data_units_written"))
    temp = _as_int(log.get("temperature"))
    # The SMART log stores kelvin; some nvme-cli versions print it converted to celsius.
    if temp is not None and temp > 200:
        temp -= 273
    return {
        "status": "ok",
        "device": node,
        "percent_used": used,
        "data_units_written": units,
        "bytes_written": units * _DATA_UNIT_BYTES if units is not None else None,
        "temperature_c": temp,
        "critical_warning": _as_int(log.get("critical_warning")),
        "power_on_hours": _as_int(log.get("power_on_hours")),
    }
