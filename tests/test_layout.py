"""The layout is the architecture: which room may import which, checked on every import.

- `allocator.capacity` (who holds which block) and `allocator.nwor` (what reaches the pool)
  never import each other; `allocator.common` imports neither; nothing in `allocator` imports
  `server` or `worker`.
- In `server`: `contract` imports neither `service` nor `transport`, and `service` never imports
  `transport`. Only the edges (`client`, `serve`, `cli`, `devtools`) see every layer.
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

# (importer prefix, imported prefix): a module under the first may not import one under the second.
FORBIDDEN = (
    ("allocator.capacity", "allocator.nwor"),
    ("allocator.nwor", "allocator.capacity"),
    ("allocator.common", "allocator.capacity"),
    ("allocator.common", "allocator.nwor"),
    ("allocator.common", "allocator.tools"),
    ("allocator", "server"),
    ("allocator", "worker"),
    ("server.contract", "server.service"),
    ("server.contract", "server.transport"),
    ("server.contract", "server.devtools"),
    ("server.service", "server.transport"),
    ("server.service", "server.devtools"),
    ("server.transport", "server.devtools"),
    ("server", "worker"),
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
                if _under(importer, source) and _under(imported, target):
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


@pytest.mark.parametrize("folder", sorted({p.parent for p in _modules()}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_folder_holds_more_than_15_modules(folder: Path) -> None:
    assert len(list(folder.glob("*.py"))) <= 15
