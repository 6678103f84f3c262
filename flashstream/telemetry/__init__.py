"""Telemetry: the device under a path, what it can do (probe), and how close an epoch ran."""

from .device import DeviceInfo, device_of, format_device
from .histogram import LatencyHistogram

# The probe() function is exported as flashstream.probe; exporting it here would shadow the
# flashstream.telemetry.probe module.
from .probe import ProbeConfig, ProbePoint, ProbeResult
from .report import EpochMonitor, EpochReport

__all__ = [
    "DeviceInfo",
    "EpochMonitor",
    "EpochReport",
    "LatencyHistogram",
    "ProbeConfig",
    "ProbePoint",
    "ProbeResult",
    "device_of",
    "format_device",
]
