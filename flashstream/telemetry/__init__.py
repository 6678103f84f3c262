"""Telemetry: what the device under a path is, and what it reports about itself."""

from .device import DeviceInfo, device_of, format_device

__all__ = [
    "DeviceInfo",
    "device_of",
    "format_device",
]
