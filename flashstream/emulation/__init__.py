"""An emulated dense drive (SLC cache, write cliff, reads held back while folding) on the
kernel's block-I/O throttle, for tests, benchmarks and users without such a drive."""

from .cgroup import ThrottleGroup, ThrottleUnavailable, throttle_support
from .emulator import DriveEmulator, EmulatorPoint
from .model import (
    PROFILES,
    RANDOM_RANGES,
    CacheModel,
    DriveSettings,
    profile_settings,
    random_settings,
)

__all__ = ["CacheModel", "DriveEmulator", "DriveSettings", "EmulatorPoint", "PROFILES",
           "RANDOM_RANGES", "ThrottleGroup", "ThrottleUnavailable", "profile_settings",
           "random_settings", "throttle_support"]
