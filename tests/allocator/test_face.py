"""The library's face, `kvalloc.allocator`: each name it lists is the object of the module it
names, imported when first asked for, so that asking for a light one (the pool's configuration,
the errors, the KV event types) loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kvalloc.allocator as face
import pytest


def test_every_name_the_face_lists_is_its_modules_own() -> None:
    for name in face.__all__:
        module = importlib.import_module(f"kvalloc.allocator.{face._HOMES[name]}")
        assert getattr(face, name) is getattr(module, name), name
    assert set(face.__all__) <= set(dir(face))


def test_a_name_the_face_does_not_list_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        face.Nothing  # noqa: B018


def test_the_configuration_errors_and_event_types_load_no_torch() -> None:
    code = ("import sys\nfrom kvalloc.allocator import KVAllocError, PoolConfig, WireShape\n"
            "PoolConfig.model_fields\nprint('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "False"), r.stderr
