"""The resume hand-off between the process that made a stream and its DataLoader workers.

A state loaded in the main process resumes one pass: the first in this process, or in each
DataLoader worker the first it starts after the load. Workers read the state from a shared
note and claim it, so persistent workers see a later load too and a later pass does not
resume it again. A state loaded in a worker (StatefulDataLoader hands each worker its own)
resumes that worker's next pass. The epoch set last in the main process, the epoch a worker
last started and the last pass started travel the same way (see shared_notes.py).
"""

from __future__ import annotations

import copy
import json
import uuid
import warnings
from typing import Any, Dict, Optional

from ..world import Worker, in_worker
from .shared_notes import Claims, SharedNote, WorkerMarks

__all__ = ["Handoff"]

_REPEAT_WARNED = False  # the repeated-epoch warning is given once per process


class Handoff:
    """One stream's notes to and from its DataLoader workers, and the state it has loaded
    but not yet resumed. Made in the process that builds the stream, so workers share it."""

    def __init__(self) -> None:
        self._marks = WorkerMarks()
        self._main_epoch = SharedNote()  # the epoch set in this process, for persistent workers
        self._loaded = SharedNote()  # {"token", "state"} loaded in this process, for workers
        self._claims = Claims()  # "<token>-<worker>": that worker resumed that loaded state
        self._passes_note = SharedNote()  # "<epoch> <pass>": the last pass started (see below)
        self._passes = 0  # passes started in this process
        self._pending: Optional[Dict[str, Any]] = None  # a loaded state not yet resumed
        self._pending_token = ""  # names a state loaded in the main process (see _loaded)

    def derived(self) -> Handoff:
        """Notes of their own for a stream derived from this one (a pipeline's), which
        follows the epoch set on either: the main-epoch note is shared."""
        new = Handoff()
        new._main_epoch = self._main_epoch
        return new

    # -- epochs -------------------------------------------------------------------------------
    def epoch_set(self, epoch: int) -> None:
        """The stream's epoch is now ``epoch``: a state pending for another one is dropped,
        and in the main process the note persistent workers follow is updated."""
        if self._pending is not None and self._pending["epoch"] != epoch:
            self.drop_pending()
        if not in_worker():
            self._main_epoch.write(str(epoch))

    def main_epoch(self) -> Optional[int]:
        """The epoch set last in the main process, if any."""
        text = self._main_epoch.read()
        return int(text) if text.isdigit() else None

    def worker_started(self, epoch: int) -> None:
        self._marks.mark(epoch)

    def workers_reading(self, epoch: int) -> bool:
        """True in the main process while DataLoader workers read ``epoch``."""
        return not in_worker() and self._marks.last() == epoch

    def note_pass(self, info: Optional[Worker], epoch: int, *, shuffled: bool,
                  resumed: bool) -> None:
        """Warn (once per process) when a shuffled epoch starts over without ``set_epoch``:
        its order would repeat (webdataset's random shuffles differ every epoch)."""
        self._passes += 1
        if not shuffled:
            return
        # A pass is known by the DataLoader iteration that runs it (the workers of one
        # iteration share its base seed) and by how many passes this process started.
        base = info.seed - info.id if info is not None else "main"
        this = f"{base}:{self._passes}"
        last = self._passes_note.read().split()
        self._passes_note.write(f"{epoch} {this}")
        if resumed or len(last) != 2 or last[0] != str(epoch) or last[1] == this:
            return
        global _REPEAT_WARNED
        if not _REPEAT_WARNED:
            _REPEAT_WARNED = True
            warnings.warn(f"flashstream: epoch {epoch} of a shuffled stream starts again "
                          f"without set_epoch(), so it repeats the last pass's order; call "
                          f"set_epoch(epoch) before each epoch (flashstream.WebLoader does it "
                          f"for you)", stacklevel=4)

    # -- loaded states ------------------------------------------------------------------------
    def load(self, state: Dict[str, Any]) -> None:
        """Hold ``state`` for the next pass (in the main process: for the workers too)."""
        self.drop_pending()
        if not state["num_workers"]:
            return  # nothing of the epoch delivered: a fresh pass is the resume
        self._pending = copy.deepcopy(state)
        if not in_worker():
            self._pending_token = uuid.uuid4().hex
            self._loaded.write(json.dumps({"token": self._pending_token, "state": state}))

    def drop_pending(self) -> None:
        if self._pending_token and not in_worker():
            self._loaded.write("")  # workers started later must not resume it either
        self._pending, self._pending_token = None, ""

    def pending(self) -> Optional[Dict[str, Any]]:
        """A copy of the loaded state no pass has resumed yet, if any."""
        if self._pending_token and self._claims.claimed(self._pending_token):
            self.drop_pending()  # DataLoader workers resumed it and read on
        return copy.deepcopy(self._pending) if self._pending is not None else None

    def take(self, info: Optional[Worker], epoch: int) -> Optional[Dict[str, Any]]:
        """The loaded state the pass starting now (in ``epoch``) resumes, if any."""
        if info is None:
            resume, token = self._pending, self._pending_token
            self.drop_pending()
            if resume is not None and token and self._claims.claimed(token):
                return None  # DataLoader workers resumed it already
            return resume
        if self._pending is not None and not self._pending_token:
            resume, self._pending = self._pending, None  # loaded in this worker
            return resume
        self.drop_pending()  # a copy of the main process's: its note is the one to read
        loaded = self._loaded.read()
        if not loaded:
            return None
        try:
            note = json.loads(loaded)
        except ValueError:
            return None
        state = note["state"]
        if state["epoch"] != epoch or not self._claims.claim(note["token"], info.id):
            return None
        return state
