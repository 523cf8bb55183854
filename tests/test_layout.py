"""The layout is the architecture: which room may import which, checked on every import.

- `allocator.capacity` (who holds which block) and `allocator.nwor` (what reaches the pool)
  never import each other; `allocator.common` imports neither; nothing in `allocator` imports
  `server` or `worker`.
- `allocator.tools` (the simulator) is imported by nothing outside it; what every command shares
  is `allocator.commands`, which imports no other room of the allocator.
- In `server`: `contract` imports neither `service` nor `transport`, and `service` never imports
  `transport`. Only the edges (`client`, `serve`, `cli`, `devtools`) see every layer.
- `worker` uses the service through `server.client` alone, an in-process one included; it never
  imports `server.service`.
- Every folder of the product holds at most 15 modules, so `ls` stays readable.
- Every class of the product is at most 300 lines with at most 20 methods (every `def` directly
  in its body, properties included), and every function or method at most 80 lines: past that a
  class is usually doing more than one job, and a reader can no longer hold a function in view.

Imports are read with `ast`, relative ones resolved, and those inside functions count too: a
lazy import is still a dependency. Sizes are read with `ast` too, nested classes and functions
included.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("allocator", "server", "worker")
MAX_CLASS_LINES = 300
MAX_CLASS_METHODS = 20
MAX_FUNCTION_LINES = 80

# (importer prefix, imported prefix): a module under the first may not import one under the second,
# unless it is itself under the second (a room's modules import each other).
FORBIDDEN = (
    ("allocator.capacity", "allocator.nwor"),
    ("allocator.nwor", "allocator.capacity"),
    ("allocator.common", "allocator.capacity"),
    ("allocator.common", "allocator.nwor"),
    ("allocator.commands", "allocator.capacity"),
    ("allocator.commands", "allocator.nwor"),
    ("allocator.commands", "allocator.common"),
    # The simulator's room is its own: the rest of allocator, server and worker stay out. The
    # `kvalloc` dispatcher (`server.cli`) is the one way in, and needs no exception: it imports
    # `allocator.tools.simulate` by name (importlib) when that command runs, not by a statement.
    ("allocator", "allocator.tools"),
    ("server", "allocator.tools"),
    ("worker", "allocator.tools"),
    ("allocator", "server"),
    ("allocator", "worker"),
    ("server.contract", "server.service"),
    ("server.contract", "server.transport"),
    ("server.contract", "server.devtools"),
    ("server.service", "server.transport"),
    ("server.service", "server.devtools"),
    ("server.transport", "server.devtools"),
    ("server", "worker"),
    ("worker", "server.service"),
    ("worker.attention", "worker.step"),
    ("worker.attention", "worker.engine"),
    ("worker.step", "worker.engine"),
    ("worker.norm", "worker.step"),
    ("worker.norm", "worker.engine"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every project module ``path`` imports, as absolute dotted names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # `from pkg import mod` imports pkg.mod when mod is a module
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def crossings(modules: list[Path]) -> list[str]:
    """``importer -> imported`` for every import the layout forbids."""
    found = []
    for path in modules:
        importer = _module_name(path)
        for imported in sorted(_imports(path)):
            for source, target in FORBIDDEN:
                if (_under(importer, source) and _under(imported, target)
                        and not _under(importer, target)):
                    found.append(f"{importer} -> {imported}")
    return found


def test_no_import_crosses_a_boundary_of_the_layout() -> None:
    assert crossings(_modules()) == []


def test_the_check_sees_a_crossing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself can fail: a planted lazy, relative import from nwor into capacity."""
    fake = tmp_path / "allocator" / "nwor" / "planted.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..capacity import manager\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossings([fake]) == ["allocator.nwor.planted -> allocator.capacity",
                                 "allocator.nwor.planted -> allocator.capacity.manager"]


def test_only_the_simulators_own_modules_import_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted import of the simulator from the server is a crossing; the same import inside
    `allocator.tools` is not (a room's modules import each other)."""
    planted = []
    for room in ("server/devtools", "allocator/tools"):
        fake = tmp_path / room / "planted.py"
        fake.parent.mkdir(parents=True)
        fake.write_text("from allocator.tools.simulate import simulate\n")
        planted.append(fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert crossings(planted) == [
        "server.devtools.planted -> allocator.tools.simulate",
        "server.devtools.planted -> allocator.tools.simulate.simulate"]


@pytest.mark.parametrize("folder", sorted({p.parent for p in _modules()}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_folder_holds_more_than_15_modules(folder: Path) -> None:
    assert len(list(folder.glob("*.py"))) <= 15


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _definitions(path: Path) -> Iterator[tuple[str, ast.ClassDef | Function]]:
    """Every class and function in ``path``, nested ones too, named ``file:line Qual.name``."""
    where = path.relative_to(ROOT)

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.ClassDef | Function]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{where}:{child.lineno} {prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text()), "")


def _lines(node: ast.AST) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def oversized_classes(modules: list[Path]) -> list[str]:
    """``file:line Class: size`` for every class over the bar on lines or on methods."""
    found = []
    for path in modules:
        for name, node in _definitions(path):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                          for item in node.body)
            if _lines(node) > MAX_CLASS_LINES:
                found.append(f"{name}: {_lines(node)} lines (at most {MAX_CLASS_LINES})")
            if methods > MAX_CLASS_METHODS:
                found.append(f"{name}: {methods} methods (at most {MAX_CLASS_METHODS})")
    return found


def oversized_functions(modules: list[Path]) -> list[str]:
    """``file:line function: size`` for every function or method over the bar on lines."""
    return [f"{name}: {_lines(node)} lines (at most {MAX_FUNCTION_LINES})"
            for path in modules for name, node in _definitions(path)
            if not isinstance(node, ast.ClassDef) and _lines(node) > MAX_FUNCTION_LINES]


def test_no_class_is_over_300_lines_or_20_methods() -> None:
    found = oversized_classes(_modules())
    assert found == [], "classes over the size bar:\n" + "\n".join(found)


def test_no_function_is_over_80_lines() -> None:
    found = oversized_functions(_modules())
    assert found == [], "functions over the size bar:\n" + "\n".join(found)


def test_the_check_sees_an_oversized_class_and_function(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The size checks themselves can fail: a planted class of 21 methods and 301 lines, one of
    them an async method of 81 lines, and a class of exactly 20 methods and 300 lines that
    passes."""
    fake = tmp_path / "allocator" / "planted.py"
    fake.parent.mkdir(parents=True)
    big = ["class Big:", "    async def long(self):", *["        pass"] * 80,
           *[f"    def m{i}(self):\n        pass" for i in range(20)], *["    x = 0"] * 179]
    fits = ["class Fits:", *[f"    def m{i}(self):\n        pass" for i in range(20)],
            *["    y = 0"] * 259]
    fake.write_text("\n".join(big + fits) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized_classes([fake]) == [
        "allocator/planted.py:1 Big: 301 lines (at most 300)",
        "allocator/planted.py:1 Big: 21 methods (at most 20)"]
    assert oversized_functions([fake]) == [
        "allocator/planted.py:2 Big.long: 81 lines (at most 80)"]
