"""The worker's one error tree: every exception class the worker defines is in `worker.errors`,
under `WorkerError`, and still the builtin callers catch it as."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from kvalloc.allocator.errors import NworInputError
from kvalloc.worker import errors

WORKER = Path(errors.__file__).parent
CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, BaseException) and c.__module__ == errors.__name__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_a_worker_error(cls: type) -> None:
    assert issubclass(cls, errors.WorkerError)


@pytest.mark.parametrize(("cls", "builtin"), [
    (errors.EngineError, RuntimeError), (errors.RankFailed, RuntimeError),
    (errors.ModelLoadError, ValueError), (errors.ShardingError, ValueError),
    (errors.DrafterSpecError, ValueError), (errors.DeviceUnavailable, ValueError),
    (errors.PromptFileError, ValueError), (errors.KvallocAttentionError, ValueError),
    (errors.RotaryError, ValueError), (errors.RmsNormError, ValueError),
    (errors.GatedMlpError, ValueError), (errors.PoolAttentionInputError, NworInputError),
], ids=lambda c: c.__name__)
def test_each_keeps_what_callers_catch_it_as(cls: type, builtin: type) -> None:
    assert issubclass(cls, builtin)


def test_no_other_module_of_the_worker_defines_an_exception() -> None:
    defined = {}
    for path in sorted(WORKER.rglob("*.py")):
        if path == Path(errors.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception"))
                    for b in node.bases):
                defined[node.name] = path.relative_to(WORKER)
    assert defined == {}
