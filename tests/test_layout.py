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
- Every folder of the product holds at most 15 modules, so `ls` stays readable.

Imports are read with `ast`, relative ones resolved, and those inside functions count too: a
lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("allocator", "server", "worker")

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
    fake.write_text("from allocator.nwor.fence import WriterFence\n"
                    "from allocator import WriterFence\n"
                    "from allocator.common.jit import jit\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert past_the_face([fake]) == ["worker.planted -> allocator.nwor.fence"]


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
