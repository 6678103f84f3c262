"""Layers import one way (ARCHITECTURE.md): the imports of every module, read from its source,
lazy ones included, reach only its own part of the package or a layer below it; no import
circle; only the engine facade imports the extension; only the world asks who we are."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import flashstream

PACKAGE = Path(flashstream.__file__).resolve().parent

#: Top to bottom. A unit (a module, or a package with its modules) may import its own modules
#: and any unit of a lower layer; units of one layer import each other only where the layer
#: says ``sideways`` (the helpers build on each other; the three jobs never do).
LAYERS: List[Tuple[str, bool, Tuple[str, ...]]] = [
    ("public API", True, ("flashstream", "flashstream.__main__", "flashstream.cli",
                          "flashstream.shard_writer")),
    ("pipeline", False, ("flashstream.pipeline",)),
    ("jobs", False, ("flashstream.stream", "flashstream.checkpoint", "flashstream.retrieval",
                     "flashstream.emulation")),
    ("batches", False, ("flashstream.batches",)),
    ("telemetry", False, ("flashstream.telemetry",)),
    ("engine facade", True, ("flashstream.engine", "flashstream._pyengine",
                             "flashstream._core")),
    ("pure helpers", True, ("flashstream.sizes", "flashstream.errors", "flashstream.settings",
                            "flashstream.world", "flashstream.pagecache",
                            "flashstream.mappings")),
]

#: Modules allowed to do what only one place should (see the tests below), with the reason.
ONLY_THE_ENGINE_IMPORTS_THE_CORE = {"flashstream.engine"}
WORLD_QUESTIONS = re.compile(r"\bget_worker_info\b|\bdist\.get_rank\b|\bdist\.get_world_size\b")
ASKS_THE_WORLD = {"flashstream.world"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("flashstream",) + parts)


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, lazy ones included."""
    module = _module_name(path)
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


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(name: str) -> Tuple[int, str]:
    """(layer index, unit) of a flashstream module: the longest unit it lies in. The package
    itself ("flashstream", its __init__) holds only itself: as a prefix it would hold every
    module, and a module left out of the table would pass unseen."""
    best = (-1, "")
    for index, (_, _, units) in enumerate(LAYERS):
        for unit in units:
            inside = name == unit or (unit != "flashstream" and name.startswith(unit + "."))
            if inside and len(unit) > len(best[1]):
                best = (index, unit)
    if best[0] < 0:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS")
    return best


def _target(name: str, modules: Dict[str, Path]) -> str:
    """The module an imported name loads: ``pkg.mod`` for ``from pkg import mod``, else the
    longest known module it starts with."""
    units = {unit for _, _, listed in LAYERS for unit in listed}  # the extension is one
    while name not in modules and name not in units and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _flashstream_imports(path: Path) -> Iterator[Tuple[int, str]]:
    for line, name in _imports(path):
        if name == "flashstream" or name.startswith("flashstream."):
            yield line, name


def test_every_module_has_a_layer():
    for name in _modules():
        _unit(name)


def test_a_module_left_out_of_the_table_fails():
    import pytest

    with pytest.raises(AssertionError, match="in no layer"):
        _unit("flashstream.something_new")
    assert _unit("flashstream") == (0, "flashstream")
    assert _unit("flashstream.checkpoint.writer") == (2, "flashstream.checkpoint")


def test_layers_import_one_way():
    offences = []
    modules = _modules()
    for name, path in modules.items():
        layer, unit = _unit(name)
        sideways = LAYERS[layer][1]
        for line, imported in _flashstream_imports(path):
            their_layer, their_unit = _unit(_target(imported, modules))
            if their_unit == unit or their_layer > layer or (their_layer == layer and sideways):
                continue
            where = "sideways" if their_layer == layer else "upward"
            offences.append(f"{path.relative_to(PACKAGE)}:{line} imports {imported} ({where}: "
                            f"{LAYERS[layer][0]} -> {LAYERS[their_layer][0]})")
    assert not offences, "imports against the layers:\n" + "\n".join(offences)


def test_no_import_circle():
    modules = _modules()
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, imported in _flashstream_imports(path):
            target = _target(imported, modules)
            package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
            # A module's own package (its __init__) is loaded before the module: not an edge.
            if target != name and not (target == package or package.startswith(target + ".")):
                graph[name].add(target)
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in circles)


def _strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(component)
    return out


def test_only_the_engine_facade_imports_the_extension():
    found = [f"{name} imports {imported}" for name, path in _modules().items()
             for _, imported in _flashstream_imports(path)
             if imported.startswith("flashstream._core") and
             name not in ONLY_THE_ENGINE_IMPORTS_THE_CORE]
    assert not found, "\n".join(found)


def test_only_the_world_asks_rank_and_worker():
    found = [f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
             for name, path in _modules().items() if name not in ASKS_THE_WORLD
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if WORLD_QUESTIONS.search(line.split("#")[0])]
    assert not found, "ask flashstream.world instead:\n" + "\n".join(found)


#: The C++ core includes one way too: Python and nanobind headers only under csrc/bindings/,
#: so the core builds and is unit-tested without Python (CMakeLists.txt says the same).
PYTHON_HEADERS = re.compile(r'^\s*#\s*include\s*[<"](Python\.h|nanobind/)')


def test_only_the_bindings_include_python_headers():
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    if not csrc.is_dir():
        import pytest
        pytest.skip("run from a source checkout: no csrc/ beside the tests")
    sources = [p for p in csrc.rglob("*") if p.suffix in (".cpp", ".hpp", ".h", ".cc")]
    found = [f"{p.relative_to(csrc)}:{n}: {line.strip()}" for p in sources
             if "bindings" not in p.relative_to(csrc).parts[:1]
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if PYTHON_HEADERS.match(line)]
    assert any("bindings" in p.parts for p in sources), "csrc/bindings/ not found"
    assert not found, "Python headers outside csrc/bindings/:\n" + "\n".join(found)


#: What each folder of the C++ core may include besides itself (ARCHITECTURE.md): common/
#: below all; telemetry/'s histograms below io/, whose engines record into them; the readers
#: and writers of formats above. A folder missing from the table fails.
CPP_INCLUDES = {
    "common": set(),
    "telemetry": {"common"},
    "io": {"common", "telemetry"},
    "tar": {"common"},
    "snapshot": {"common"},
    "index": {"common", "telemetry", "io", "tar"},
    "probe": {"common", "telemetry", "io"},
}
#: Folders that link the core and may include any of it.
CPP_ABOVE_THE_CORE = {"bindings", "tests", "fuzz"}
CPP_INCLUDE = re.compile(r'^\s*#\s*include\s*"([a-z_]+)/')


def test_the_cpp_core_includes_one_way():
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    if not csrc.is_dir():
        import pytest
        pytest.skip("run from a source checkout: no csrc/ beside the tests")
    offences = []
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in (".cpp", ".hpp", ".h")):
        folder = path.relative_to(csrc).parts[0]
        if folder in CPP_ABOVE_THE_CORE:
            continue
        if folder not in CPP_INCLUDES:
            offences.append(f"csrc/{folder}/ is in no layer: add it to CPP_INCLUDES")
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = CPP_INCLUDE.match(line)
            if found and found.group(1) not in CPP_INCLUDES[folder] | {folder}:
                offences.append(f"{path.relative_to(csrc)}:{number} includes "
                                f"{found.group(1)}/")
    assert not offences, "C++ includes against the layers:\n" + "\n".join(offences)


def test_the_check_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    fake = tmp_path / "flashstream"
    (fake / "stream").mkdir(parents=True)
    (fake / "stream" / "x.py").write_text(
        "def f():\n    from ..pipeline.pipeline import Pipeline\n    import flashstream.cli\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = [name for _, name in _imports(fake / "stream" / "x.py")]
    assert found == ["flashstream.pipeline.pipeline.Pipeline", "flashstream.cli"]


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(map(sorted, _strongly_connected(graph))) == [["a", "b", "c"], ["d"]]
