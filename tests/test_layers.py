"""Layers import one way (DESIGN.md): the imports of every module, read from its source, must not
reach a layer above it. The table holds the rules in force; a rule is added here as its layer is
made clean."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import flashstream

PACKAGE = Path(flashstream.__file__).resolve().parent

#: package (dotted, under flashstream) -> what none of its modules may import.
FORBIDDEN = {
    "stream": ("flashstream.pipeline", "flashstream.cli"),
    "retrieval": ("flashstream.stream", "flashstream.pipeline", "flashstream.checkpoint",
                  "flashstream.cli"),
}


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, lazy ones included."""
    module = "flashstream." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def test_layers_import_one_way():
    offences = []
    for layer, banned in FORBIDDEN.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for line, name in _imports(path):
                if any(name == b or name.startswith(b + ".") for b in banned):
                    offences.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not offences, "imports against the layers:\n" + "\n".join(offences)


def test_the_check_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    fake = tmp_path / "flashstream"
    (fake / "stream").mkdir(parents=True)
    (fake / "stream" / "x.py").write_text(
        "def f():\n    from ..pipeline.pipeline import Pipeline\n    import flashstream.cli\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = [name for _, name in _imports(fake / "stream" / "x.py")]
    assert found == ["flashstream.pipeline.pipeline.Pipeline", "flashstream.cli"]
