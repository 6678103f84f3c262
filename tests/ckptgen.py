"""State dicts for the checkpoint tests: what training saves, made deterministic from a step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def training_state(step: int = 0, *, width: int = 64) -> dict:
    """A model's and an Adam optimizer's state dicts after one step, plus plain values."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "loss": 0.25 * step, "name": f"run-{step}", "rng": torch.get_rng_state()}


def every_kind(step: int = 0) -> dict:
    """Every dtype and value kind the writer supports, with awkward shapes and views."""
    g = torch.Generator().manual_seed(step)
    base = torch.randn(7, 9, generator=g)
    out: dict = {
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "f16": base.half(), "bf16": base.bfloat16(),
        "i64": torch.arange(11, dtype=torch.int64) * (step + 1),
        "i32": torch.arange(-5, 6, dtype=torch.int32),
        "i16": torch.tensor([-3, 4], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(13, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
        "odd": torch.arange(3, dtype=torch.uint8),
        "transposed": base.t(), "strided": base[::2, 1::3],
        "expanded": torch.ones(3, 1).expand(3, 4),
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "numpy": np.arange(6, dtype=np.float32).reshape(2, 3) + step,
        "plain": {"int": 7, "float": 1.5, "nan": math.nan, "inf": -math.inf, "str": "héllo/a.b",
                  "none": None, "true": True, "bytes": b"\x00\xff", "tuple": (1, "two", 3.0),
                  "list": [1, [2, [3]]], 0: "int key", (1, 2): "tuple key", 2.5: "float key"},
        "a/b": torch.ones(1), "a": {"b": torch.zeros(1)},  # names that would collide
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            out[name] = torch.arange(4).to(getattr(torch, name))
    return out


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Equal values, types, dtypes, shapes and nesting (nan equals nan)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.device.type == b.device.type, where
        x, y = a.detach().cpu(), b.detach().cpu()
        if x.dtype.is_floating_point and x.element_size() == 1:  # float8 has no equal kernel
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), where
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        np.testing.assert_array_equal(a, b)
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where
