"""msgspec structs derived from the pydantic contract in `server.contract.protocol`, and their
codecs.

The IPC transport and the client speak these structs; REST validates with the pydantic models.
Deriving (rather than writing the structs a second time) keeps one definition of every field,
default and constraint: `struct_for` copies each model's annotations, which carry
``msgspec.Meta`` next to pydantic's ``Field``, and replaces nested models by their structs.

The step's messages exist in two encodings. ``struct_for(M)`` keeps the model's shape, every
`protocol.Column` a list of integers: the JSON of REST, and of the core's tests. On IPC,
`StepRequestBinary` and `StepReplyBinary` carry the same fields packed: every column of the
message, in the order `column_paths` gives, back to back in one buffer of little-endian int64
(``columns``, a msgpack ``bin``) with each column's length (``lengths``); the scalars and strings
beside them keep their annotations. One buffer a message costs one copy on each side, where a
buffer per column cost a Python call per column.

Invariant: for every model M, ``struct_for(M)`` has the same field names, order and defaults, and
msgspec's JSON for a struct validates as M (tested in
tests/server/contract/test_service_protocol.py).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec
from kvalloc.server.contract import protocol
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

S = TypeVar("S", bound=msgspec.Struct)


@functools.cache
def struct_for(model: type[BaseModel]) -> type[msgspec.Struct]:
    """The frozen, unknown-field-rejecting msgspec struct mirroring ``model``."""
    hints = typing.get_type_hints(model, include_extras=True)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        tp = _wire_type(hints[name])
        factory = info.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            fields.append((name, tp, msgspec.field(default_factory=struct_for(factory))))
        elif factory is not None:
            fields.append((name, tp, msgspec.field(default_factory=factory)))
        elif info.default is not PydanticUndefined:
            fields.append((name, tp, info.default))
        else:
            fields.append((name, tp))
    return _struct(model.__name__, fields)


def _struct(name: str, fields: list[tuple[str, Any] | tuple[str, Any, Any]]
            ) -> type[msgspec.Struct]:
    return msgspec.defstruct(name, fields, kw_only=True, frozen=True, forbid_unknown_fields=True,
                             module=__name__)


def column_of(tp: Any) -> protocol.Column | None:
    """The `protocol.Column` marker of an annotation, if it is a column."""
    if get_origin(tp) is Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, protocol.Column)), None)
    return None


def _wire_type(tp: Any) -> Any:
    """``tp`` with every pydantic model inside it replaced by its struct."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return struct_for(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin is None or origin is Literal:
        return tp
    if origin is Annotated:
        return Annotated[(_wire_type(args[0]), *tp.__metadata__)]
    if origin in (Union, types.UnionType):
        return Union[tuple(_wire_type(a) for a in args)]  # noqa: UP007 - from a tuple
    return origin[tuple(_wire_type(a) for a in args)]


@functools.cache
def column_paths(model: type[BaseModel]) -> tuple[str, ...]:
    """Every column of ``model``, nested ones included (``grants.draft_lens``), in field order:
    the order of a packed message's ``columns``."""
    paths: list[str] = []
    for name, tp in typing.get_type_hints(model, include_extras=True).items():
        if column_of(tp) is not None:
            paths.append(name)
        for group in (tp, *get_args(tp)):
            if isinstance(group, type) and issubclass(group, BaseModel):
                paths += [f"{name}.{path}" for path in column_paths(group)]
    return tuple(paths)


def _annotation(model: type[BaseModel], name: str) -> Any:
    return _wire_type(typing.get_type_hints(model, include_extras=True)[name])


# ``columns`` decodes as a view of the message it came in (msgpack's ``bin`` either way): a
# carrier hands over the received bytes without copying them, and the columns are copied once,
# out of the message (`columns.StepCall.from_wire`, `columns.StepResult.from_wire`).
_PACKED: list[tuple[str, Any, Any]] = [
    ("lengths", list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.field(default_factory=list)),
    ("columns", memoryview, b""),
]
StepRequestBinary = _struct("StepRequestBinary", [
    *[(name, _annotation(protocol.StepRequest, name))
      for name in ("worker_id", "session", "epoch", "step_id")],
    ("req_ids", _annotation(protocol.NewColumns, "req_ids"), msgspec.field(default_factory=list)),
    *_PACKED])
# ``with_tables``: whether the columns of ``tables`` and ``slot_mapping`` were sent (to a worker
# that keeps its own block table), rather than left empty.
StepReplyBinary = _struct("StepReplyBinary", [
    *[(name, _annotation(protocol.StepReply, name))
      for name in ("epoch", "step_id", "committed", "free_blocks")],
    ("with_tables", bool, False), *_PACKED])


ErrorBody = struct_for(protocol.ErrorBody)
RegisterRequest = struct_for(protocol.RegisterRequest)
WorkerRef = struct_for(protocol.WorkerRef)
ShmRef = struct_for(protocol.ShmRef)
CudaRef = struct_for(protocol.CudaRef)
TensorHandle = struct_for(protocol.TensorHandle)
EventHandle = struct_for(protocol.EventHandle)
ShardAttachment = struct_for(protocol.ShardAttachment)
GroupAttachment = struct_for(protocol.GroupAttachment)
GroupLayout = struct_for(protocol.GroupLayout)
Attachment = struct_for(protocol.Attachment)
PoolLayout = struct_for(protocol.PoolLayout)
Registration = struct_for(protocol.Registration)
Deregistered = struct_for(protocol.Deregistered)
StepRequest = struct_for(protocol.StepRequest)
StepReply = struct_for(protocol.StepReply)
CommitSummary = struct_for(protocol.CommitSummary)
RequestRef = struct_for(protocol.RequestRef)
RequestState = struct_for(protocol.RequestState)
PoolQuery = struct_for(protocol.PoolQuery)
WorkerState = struct_for(protocol.WorkerState)
PoolState = struct_for(protocol.PoolState)
Health = struct_for(protocol.Health)
Readiness = struct_for(protocol.Readiness)


def from_model(model: BaseModel, struct: type[S]) -> S:
    """A validated pydantic model as its struct (REST -> core), without re-validation costs."""
    return msgspec.convert(model, struct, from_attributes=True)


# ---------------------------------------------------------------- codecs

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()


def encode_msgpack(obj: msgspec.Struct) -> bytes:
    return _msgpack.encode(obj)


def encode_json(obj: msgspec.Struct) -> bytes:
    return _json.encode(obj)


@functools.cache
def _decoder(fmt: str, struct: type[S]) -> msgspec.msgpack.Decoder[S] | msgspec.json.Decoder[S]:
    return (msgspec.msgpack.Decoder if fmt == "msgpack" else msgspec.json.Decoder)(struct)


def decode(data: bytes | memoryview, struct: type[S],
           fmt: Literal["msgpack", "json"] = "msgpack") -> S:
    """Decode and validate; raises ``msgspec.ValidationError`` / ``DecodeError``."""
    return _decoder(fmt, struct).decode(data)


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def error_field(exc: msgspec.ValidationError) -> str:
    """The input msgspec's message names, as a dotted path (``grants[3].draft_len``); 'body'
    when it names none."""
    text = str(exc)
    at = _AT.search(text)
    named = _NAMED.search(text)
    parts = [p for p in (at.group(1) if at else "", named.group(1) if named else "") if p]
    return ".".join(parts) or "body"
