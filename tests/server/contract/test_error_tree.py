"""The server package's errors are one tree, defined in one module, mapped to statuses in one
place: every public exception class in ``server`` is a `KVAllocServerError` of
`server.contract.errors`, and each refusal the service sends comes back to the client as the
same status, code and field."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kvalloc.server as server
import pytest
from kvalloc.server.contract import errors

# Private exceptions that carry control flow, not errors: a signal turned into an unwinding.
CONTROL_FLOW = {"kvalloc.server.serve._Stopped"}


def _server_exceptions() -> list[type[BaseException]]:
    found = set()
    for info in pkgutil.walk_packages(server.__path__, "kvalloc.server."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (issubclass(cls, BaseException) and cls.__module__.startswith("kvalloc.server.")
                    and f"{cls.__module__}.{cls.__qualname__}" not in CONTROL_FLOW):
                found.add(cls)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


@pytest.mark.parametrize("cls", _server_exceptions(), ids=lambda c: c.__qualname__)
def test_every_server_exception_is_in_the_one_tree(cls: type[BaseException]) -> None:
    assert cls.__module__ == errors.__name__
    assert issubclass(cls, errors.KVAllocServerError)


SERVICE_ERRORS = [c for c in _server_exceptions() if issubclass(c, errors.ServiceError)]


@pytest.mark.parametrize("cls", SERVICE_ERRORS, ids=lambda c: c.__qualname__)
def test_a_refusal_reaches_the_client_as_it_left_the_service(cls: type[errors.ServiceError]
                                                             ) -> None:
    body = errors.describe(cls("where: why"))
    back = errors.remote_error(body)
    assert (back.status, back.code, back.field) == (cls.status, cls.code, cls.field)
