"""What a CheckpointWriter checks of its arguments before anything is written: a clear
ValueError (or OSError) at the call, not a background failure at the first save's result()."""

from __future__ import annotations

import math
import operator
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_directory_name", "check_writable", "step_number"]


def step_number(step: Any) -> int:
    """An int from any integer a training loop holds: an int, a numpy integer, or a
    one-element tensor holding a whole number (AdamW keeps its step as a float32 one)."""
    if isinstance(step, torch.Tensor):
        value = step.item() if step.numel() == 1 and step.dtype != torch.bool else None
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = int(value)
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return step


#: Names that say "a file": torch.save's habits. CheckpointWriter takes a directory.
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".tar")


def check_directory_name(directory: Path) -> None:
    if directory.suffix.lower() in _FILE_SUFFIXES and not directory.is_dir():
        raise ValueError(f"CheckpointWriter writes a directory of step directories, and "
                         f"{str(directory)!r} names a file (torch.save writes one file); give a "
                         f"directory such as {str(directory.with_suffix(''))!r}")


def check_writable(directory: Path) -> None:
    """Raise now, not from the first save's result(), when nothing can be written here (a
    read-only filesystem, no permission)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".flashstream-writable-", dir=directory)
    except OSError as err:
        raise OSError(err.errno, f"checkpoint directory {directory} is not writable: "
                                 f"{err.strerror}", str(directory)) from None
    os.close(fd)
    os.unlink(name)
