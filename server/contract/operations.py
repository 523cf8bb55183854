"""The operations both transports serve, in one table: name -> request and reply structs, and the
REST method and path. The IPC transport dispatches ``name`` to the `ServiceCore` method of the same
name; the REST routes and the client's REST transport are built from the same rows, so the two
transports cannot disagree on what exists.

A *columnar* operation (the step) has two encodings of its messages, JSON lists for REST and
one packed int64 buffer for IPC (`server.contract.wire`), and the core speaks array types
(`server.contract.columns`): ``to_core`` / ``from_core`` convert at the transport's edge, the same
way on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Formatter
from typing import Any

import msgspec
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall, StepResult

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
    binary_request: type[msgspec.Struct] | None = None  # IPC encoding, for columnar operations
    binary_reply: type[msgspec.Struct] | None = None

    @property
    def path_fields(self) -> tuple[str, ...]:
        return tuple(name for _, name, _, _ in Formatter().parse(self.path) if name)

    def request_struct(self, binary: bool) -> type[msgspec.Struct]:
        return self.binary_request if binary and self.binary_request else self.request

    def reply_struct(self, binary: bool) -> type[msgspec.Struct]:
        return self.binary_reply if binary and self.binary_reply else self.reply

    def to_core(self, message: Any) -> Any:
        """A decoded request (struct, or pydantic model on REST) as the core takes it."""
        return StepCall.from_wire(message) if self.binary_request else message

    def from_core(self, value: Any, binary: bool) -> Any:
        """The core's reply as the struct a transport encodes."""
        return value.to_wire(binary) if self.binary_reply else value

    def encode_call(self, value: Any, binary: bool) -> Any:
        """Client side: what a caller passes (a `StepCall` for the step) as a struct."""
        return value.to_wire(binary) if self.binary_request else value

    def decode_reply(self, reply: Any) -> Any:
        """Client side: a decoded reply struct as the caller gets it (`StepResult`)."""
        return StepResult.from_wire(reply) if self.binary_reply else reply


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("register", wire.RegisterRequest, wire.Registration, "POST", "/v1/workers"),
    Operation("deregister", wire.WorkerRef, wire.Deregistered, "DELETE",
              "/v1/workers/{worker_id}"),
    Operation("step", wire.StepRequest, wire.StepReply, "POST", "/v1/steps",
              binary_request=wire.StepRequestBinary, binary_reply=wire.StepReplyBinary),
    Operation("get_request", wire.RequestRef, wire.RequestState, "GET",
              "/v1/requests/{req_id}"),
    Operation("get_pool", wire.PoolQuery, wire.PoolState, "GET", "/v1/pool"),
)}
