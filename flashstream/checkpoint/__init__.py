"""Asynchronous, paced, crash-safe checkpoints (see docs/checkpoint.md)."""

from .config import AdaptiveSettings, WriterConfig
from .loader import load_checkpoint, resolve_checkpoint
from .report import SaveReport
from .store import CheckpointInfo, list_checkpoints, newest_complete
from .writer import CheckpointWriter, SaveHandle

__all__ = [
    "AdaptiveSettings",
    "CheckpointInfo",
    "CheckpointWriter",
    "SaveHandle",
    "SaveReport",
    "WriterConfig",
    "list_checkpoints",
    "load_checkpoint",
    "newest_complete",
    "resolve_checkpoint",
]
