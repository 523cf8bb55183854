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
- Outside `allocator`, the library is used through its face, `allocator/__init__.py`: no module
  of `server` or `worker` imports one of the allocator's own modules, except the rooms every
  room shares (`FACE_EXCEPTIONS`, each with its reason).
- In `worker`: the loop (`engine`, `step_plans`, `launch_plans`, `requests`, `run_stats`) is
  imported by none of `attention`, `norm`, `step`, `kernels`;
  `attention` and `norm` never import `step`; `kernels` imports none of the rooms that launch
  its kernels.
- No modules import each other round a circle (imports for annotations alone excepted: they
  never run).
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
DISTRIBUTION = "kvalloc"  # the one importable name the rooms install under

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
    # The kernels are launched by the rooms, never the other way round.
    ("worker.kernels", "worker.attention"),
    ("worker.kernels", "worker.engine"),
    ("worker.kernels", "worker.mlp"),
    ("worker.kernels", "worker.norm"),
    ("worker.kernels", "worker.step"),
)
# The loop's other modules are as much the loop's as `worker.engine` is.
FORBIDDEN += tuple(
    (room, loop) for room in ("worker.attention", "worker.step", "worker.norm", "worker.kernels")
    for loop in ("worker.step_plans", "worker.launch_plans", "worker.requests", "worker.run_stats"))


# Allocator rooms that server and worker may import past the face, and why.
FACE_EXCEPTIONS = {
    # Runtime plumbing, not the allocator's state: the numba switch, whether Triton is
    # installed, pinned uploads and device placement, which every room's hot path uses alike.
    "allocator.common": "shared runtime plumbing",
    # What every `kvalloc` command shares: argument parsers, Ctrl-C at a step boundary.
    "allocator.commands": "shared command-line plumbing",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under an ``if TYPE_CHECKING:``: imports that never run."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def _imports(path: Path, *, typing: bool = True) -> set[str]:
    """Every project module ``path`` imports, as absolute dotted names (``typing``: those only
    annotations need too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = set() if typing else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
    # The rooms install under the one name (`kvalloc.allocator` is the folder `allocator/`).
    rooms = {m.removeprefix(f"{DISTRIBUTION}.") for m in found}
    return {m for m in rooms if m.split(".")[0] in PACKAGES}


def old_names(paths: list[Path]) -> list[str]:
    """``module -> imported`` for every import of a room by its folder's bare name, which no
    installed distribution provides (the rooms install as ``kvalloc.<room>``)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom)
                     and not node.level else [])
            found += [f"{path.relative_to(ROOT)} -> {name}" for name in names
                      if name.split(".")[0] in PACKAGES]
    return found


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


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def past_the_face(modules: list[Path]) -> list[str]:
    """``importer -> imported`` for every import of an allocator module from outside it that the
    face and `FACE_EXCEPTIONS` do not allow."""
    return [f"{_module_name(path)} -> {imported}" for path in modules
            if not _under(_module_name(path), "allocator")
            for imported in sorted(_imports(path))
            if _under(imported, "allocator") and imported != "allocator" and _is_module(imported)
            and not any(_under(imported, room) for room in FACE_EXCEPTIONS)]


def import_circles(modules: list[Path]) -> list[list[str]]:
    """Every set of modules that import each other round a circle (strongly connected, run-time
    imports only, lazy ones included), each sorted."""
    names = {_module_name(p): p for p in modules}
    edges = {n: sorted(i for i in _imports(p, typing=False) if i in names and i != n)
             for n, p in names.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in edges[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(names):
        if v not in order:
            visit(v)
    return circles


def test_no_modules_import_each_other_round_a_circle() -> None:
    assert import_circles(_modules()) == []


def test_the_circle_check_sees_a_lazy_circle(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two planted modules, one importing the other lazily, the other at the top: a circle; a
    third that one of them imports only for annotations is not part of it."""
    room = tmp_path / "worker"
    room.mkdir()
    (room / "a.py").write_text("from typing import TYPE_CHECKING\n"
                               "from kvalloc.worker import b\n"
                               "if TYPE_CHECKING:\n    from kvalloc.worker import c\n")
    (room / "b.py").write_text("def f():\n    from kvalloc.worker import a\n")
    (room / "c.py").write_text("from kvalloc.worker import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles(sorted(room.glob("*.py"))) == [["worker.a", "worker.b"]]


def test_server_and_worker_use_the_allocator_through_its_face() -> None:
    assert past_the_face(_modules()) == []


def test_the_face_check_sees_a_reach_past_the_face(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted import of an allocator module from the worker is flagged; the same names from
    the face, or from a shared room, are not."""
    for module in ("allocator/nwor/fence.py", "allocator/common/jit.py", "allocator/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    fake = tmp_path / "worker" / "planted.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from kvalloc.allocator.nwor.fence import WriterFence\n"
                    "from kvalloc.allocator import WriterFence\n"
                    "from kvalloc.allocator.common.jit import jit\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert past_the_face([fake]) == ["worker.planted -> allocator.nwor.fence"]


def test_every_import_names_a_room_by_the_one_importable_name() -> None:
    """The product, its tests and benchmarks import ``kvalloc.allocator``, never ``allocator``: a
    bare name would only resolve from the repository's root, and would load a second copy of a
    module beside the installed one."""
    paths = sorted(p for p in ROOT.rglob("*.py")
                   if not {".venv", "build", ".git"} & set(p.relative_to(ROOT).parts))
    assert old_names(paths) == []


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
        fake.write_text("from kvalloc.allocator.tools.simulate import simulate\n")
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
