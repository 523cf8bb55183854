"""The operations both transports serve, in one table: name -> request and reply structs, and the
REST method and path. The IPC transport dispatches ``name`` to the `ServiceCore` method of the same
name; the REST routes and the client's REST transport are built from the same rows, so the two
transports cannot disagree on what exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Formatter

import msgspec

from . import wire

# IPC reply status frames.
OK, ERROR = b"ok", b"error"


@dataclass(frozen=True)
class Operation:
    name: str
    request: type[msgspec.Struct]
    reply: type[msgspec.Struct]
    method: str
    path: str  # fields named {like_this} travel in the path; the rest in the query (GET/DELETE)
    # or the JSON body (POST)

    @property
    def path_fields(self) -> tuple[str, ...]:
        return tuple(name for _, name, _, _ in Formatter().parse(self.path) if name)


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("register", wire.RegisterRequest, wire.Registration, "POST", "/v1/workers"),
    Operation("deregister", wire.WorkerRef, wire.Deregistered, "DELETE",
              "/v1/workers/{worker_id}"),
    Operation("step", wire.StepRequest, wire.StepReply, "POST", "/v1/steps"),
    Operation("get_request", wire.RequestRef, wire.RequestState, "GET",
              "/v1/requests/{req_id}"),
    Operation("get_pool", wire.PoolQuery, wire.PoolState, "GET", "/v1/pool"),
)}
