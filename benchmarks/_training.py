"""What the checkpoint benchmarks stand in for a training process with: the state dict it saves
(Linear layers with a real Adam state, or very many small tensors), the training step that
changes every tensor between saves, and the other cores it keeps busy. checkpoint.py, its
--emulate run (_emulated.py) and its --learning run (_learning.py) all build their state here."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from typing import Dict, List

import torch

from flashstream.sizes import format_size


class _State:
    """What both generated states share: ``state`` (the dict a training loop saves) and
    ``tensors`` (each of its tensors once)."""

    state: Dict[str, object]
    tensors: List[torch.Tensor]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def mutate(self) -> None:
        """What a training step does to the state: every tensor changes, the step moves."""
        with torch.no_grad():
            for t in self.tensors:
                t.add_(1e-3 if t.dim() else 1)
        self.state["step"] += 1


class TrainingState(_State):
    """An nn.Sequential of Linear layers and a real Adam state after one step, sized so the
    tensors total about ``nbytes``: parameters, exp_avg and exp_avg_sq (float32, a third each),
    Adam's per-parameter step tensors, its param_groups, and plain int/float counters."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        n = max(nbytes // 12, 4096)  # float32 parameters; Adam keeps two more of each
        self.width = min(4096, max(16, 1 << int(math.log2(math.sqrt(n / 4)))))
        per_layer = self.width * (self.width + 1)
        full = max(1, n // per_layer)
        rest = max(0, n - full * per_layer) // (self.width + 1)
        layers = [torch.nn.Linear(self.width, self.width) for _ in range(full)]
        if rest:
            layers.append(torch.nn.Linear(self.width, rest))
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        loss = self.model(torch.randn(8, self.width)).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state: Dict[str, object] = {
            "model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
            "step": 1, "epoch": 0, "loss": loss.item(), "lr": 1e-4}
        self.tensors = _tensors(self.state)

    def describe(self) -> Dict[str, object]:
        return {"state_bytes": self.tensor_bytes, "tensors": len(self.tensors),
                "layers": len(self.model), "width": self.width,
                "parameters": sum(p.numel() for p in self.model.parameters())}

    def summary(self) -> str:
        return (f"{format_size(self.tensor_bytes)} in {len(self.tensors)} tensors "
                f"({len(self.model)} Linear layers of width {self.width}, Adam after one step)")

    def mutate(self) -> None:
        super().mutate()
        self.state["loss"] *= 0.999


class ManySmallState(_State):
    """``count`` float32 tensors of ``nbytes`` each under one dict (a model with very many small
    parameters: embeddings split per row, per-layer norms, LoRA adapters): what the stall of a
    save costs per tensor, apart from bytes."""

    def __init__(self, count: int, nbytes: int = 1024, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.state: Dict[str, object] = {
            "params": {f"block.{i}.weight": torch.randn(max(1, nbytes // 4))
                       for i in range(count)},
            "step": 1}
        self.tensors = _tensors(self.state)

    def describe(self) -> Dict[str, object]:
        return {"state_bytes": self.tensor_bytes, "tensors": len(self.tensors),
                "many_small": True}

    def summary(self) -> str:
        return (f"{format_size(self.tensor_bytes)} in {len(self.tensors)} tensors of "
                f"{format_size(self.tensors[0].numel() * 4)}")


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes spinning on the CPU for as long as the block runs (a training
    process keeps its cores busy; a save's snapshot competes with it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(max(0, count))]
    try:
        time.sleep(0.2 if procs else 0)
        yield len(procs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _tensors(value: object) -> List[torch.Tensor]:
    """Every tensor in a nested state dict, once each."""
    out: Dict[int, torch.Tensor] = {}

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            out.setdefault(id(v), v)
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(value)
    return list(out.values())
