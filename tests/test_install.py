"""The install: what `make` runs for each kind of venv, and a constraints file that never
contradicts torch's own pins (torch pins its Triton; a second pin made stock pip fail)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import triton_interpreter

ROOT = Path(__file__).resolve().parents[1]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_dry_run(tmp_path: Path, *variables: str, target: str = "run") -> str:
    """The commands `make target` would run, its venv built in ``tmp_path`` (nothing is run)."""
    # Run under `make test` too: a nested make would print its directory changes.
    r = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={tmp_path / 'venv'}",
                        *variables, target],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return r.stdout


@needs_make
def test_the_default_venv_is_isolated_and_keeps_torch_at_the_constraint(tmp_path):
    commands = make_dry_run(tmp_path, target="test")
    assert "-m venv " in commands and "--system-site-packages" not in commands
    assert "-c constraints-cpu.txt -e '.[dev,worker]'" in commands


@needs_make
def test_run_installs_what_serve_needs_and_no_extra(tmp_path):
    """`serve` imports neither Triton nor transformers: `make run` installs the package alone,
    and `make test` adds the dev and worker extras on top of that same install."""
    run = make_dry_run(tmp_path)
    assert "-c constraints-cpu.txt -e .\n" in run and "[" not in run, run
    assert run.rstrip().endswith("kvalloc serve"), run
    test = make_dry_run(tmp_path, target="test")
    assert test.index("-e .\n") < test.index("-e '.[dev,worker]'") < test.index("-m pytest")


@needs_make
@pytest.mark.parametrize("variable", ["SYSTEM_TORCH=1", "TORCH_CONSTRAINT=/dev/null"])
def test_system_torch_builds_over_site_packages_and_pins_nothing(tmp_path, variable):
    commands = make_dry_run(tmp_path, variable, target="test")
    assert "-m venv --system-site-packages " in commands
    assert "-c /dev/null -e .\n" in commands
    assert "-c /dev/null -e '.[dev,worker]'" in commands
    assert "constraints-cpu.txt -e" not in commands


def test_the_constraints_pin_torch_alone():
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints-cpu.txt").read_text()
            .splitlines()]
    assert [p for p in pins if p] == ["torch==2.13.0"]


def test_the_triton_interpreter_tests_skip_with_a_reason_only_below_the_oldest_checked(
        monkeypatch: pytest.MonkeyPatch):
    def installed(version: str | None):
        def lookup(name: str) -> str:
            if version is None:
                raise metadata.PackageNotFoundError(name)
            return version
        return lookup

    monkeypatch.setattr(metadata, "version", installed("3.5.2"))
    assert triton_interpreter.triton_interpreter_gap() == (
        "triton 3.5.2: its interpreter predates 3.6, the oldest checked")
    for version in ("3.6.0", "3.7.1", "3.9.0", "4.0.0+git1234"):
        monkeypatch.setattr(metadata, "version", installed(version))
        assert triton_interpreter.triton_interpreter_gap() is None, version
    monkeypatch.setattr(metadata, "version", installed(None))
    assert triton_interpreter.triton_interpreter_gap() == "triton is not installed"


def test_the_distribution_lists_every_package_of_its_rooms():
    """pyproject names each package the build installs (a package-dir mapping finds none by
    itself): every folder with an ``__init__.py`` under a room, under the one name."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {"kvalloc"} | {
        ".".join(("kvalloc", *init.parent.relative_to(ROOT).parts))
        for room in ("allocator", "server", "worker")
        for init in (ROOT / room).rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk
    assert setuptools["package-dir"] == {"kvalloc": "kvalloc", "kvalloc.allocator": "allocator",
                                         "kvalloc.server": "server", "kvalloc.worker": "worker"}


def test_an_engine_with_its_own_server_package_imports_the_client(tmp_path):
    """Run where an engine author's project has a ``server/`` package of its own: kvalloc's
    client imports under its one name, the author's ``server`` stays theirs, and the
    distribution installs no generic top-level name."""
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "__init__.py").write_text("OWN = True\n")
    script = ("import importlib.util, server\n"
              "from kvalloc.server.client import Client\n"
              "assert server.OWN and Client.__module__ == 'kvalloc.server.client'\n"
              "print([n for n in ('allocator', 'worker')\n"
              "       if importlib.util.find_spec(n) is not None])\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
