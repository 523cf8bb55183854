"""The per-step call as arrays: `StepCall` in, `StepResult` out, and their two wire encodings.

The core consumes a `StepCall` and produces a `StepResult`, both made of int64 numpy columns, so
the step path holds no Python object per request between the wire and the manager. A transport
converts once at its edge: an IPC message packs its columns into one buffer of little-endian
int64 (one copy out of the message, then views), REST columns are JSON lists; the in-process client
hands the arrays over as they are.

Every column is checked here, with the bounds its `protocol.Column` declares, whichever way it
arrived: a bad one raises `MalformedBody` naming the element (``grants.draft_lens[3]``).
"""

from __future__ import annotations

import functools
import operator
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
from kvalloc.allocator import compiled_type
from kvalloc.allocator.common.jit import jit, numba, views
from kvalloc.server.contract import protocol, wire
from kvalloc.server.contract.errors import MalformedBody
from pydantic import BaseModel

INT64 = np.dtype("<i8")
# A call's every column is one array type, int64, contiguous and writable, so that each compiled
# loop of the step is compiled once (numba compiles a read-only or strided array apart, which a
# step would pay the first time it met one). The empty column too: it holds nothing to protect.
NO_VALUES = np.zeros(0, dtype=np.int64)

ColumnInput = Sequence[int] | np.ndarray | bytes | memoryview

# StepCall attribute -> (group, column) of `protocol.StepRequest`, in StepCall's field order
# (``new_req_ids`` stands before the last three).
_REQUEST_COLUMNS: dict[str, tuple[str, str]] = {
    "result_handles": ("results", "handles"),
    "num_accepted": ("results", "num_accepted"),
    "revert_handles": ("reverts", "handles"),
    "finished_handles": ("finished", "handles"),
    "grant_handles": ("grants", "handles"),
    "draft_lens": ("grants", "draft_lens"),
    "padding_handles": ("padding", "handles"),
    "padded_draft_lens": ("padding", "padded_draft_lens"),
    "prefill_handles": ("prefill", "handles"),
    "prefill_tokens": ("prefill", "num_tokens"),
    "prompt_lens": ("new", "prompt_lens"),
    "first_chunks": ("new", "first_chunks"),
    "prompt_token_ids": ("new", "prompt_token_ids"),
}
# The same columns as the wire names and packs them (``grants.draft_lens``), in the same order
# (tested).
_REQUEST_PATHS = wire.column_paths(protocol.StepRequest)
_COLUMN_INDEX = {column: i for i, column in enumerate(_REQUEST_COLUMNS.values())}
# Columns of one group that pair up element by element: (group, first, second, and the two
# columns' indices in `_REQUEST_COLUMNS` order).
_PAIRED = tuple((group, first, second, _COLUMN_INDEX[group, first], _COLUMN_INDEX[group, second])
                for group, first, second in (("results", "handles", "num_accepted"),
                                             ("grants", "handles", "draft_lens"),
                                             ("padding", "handles", "padded_draft_lens"),
                                             ("prefill", "handles", "num_tokens")))


@functools.cache
def _bounds(model: type[BaseModel]) -> dict[str, protocol.Column]:
    hints = typing.get_type_hints(model, include_extras=True)
    return {name: col for name, tp in hints.items() if (col := wire.column_of(tp)) is not None}


_BYTES = (bytes, bytearray, memoryview)


def as_int64(value: ColumnInput, where: str) -> np.ndarray:
    """``value`` as a flat int64 array (int64 bytes are viewed, not copied); `MalformedBody`
    naming ``where`` if it holds anything but integers."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype == INT64:
        return value if value.size else NO_VALUES  # a step's columns, usually: nothing to do
    if isinstance(value, _BYTES):
        if not value:
            return NO_VALUES
        try:
            return np.frombuffer(value, dtype=INT64)
        except ValueError:  # not a whole number of int64
            raise MalformedBody(f"{where}: {len(value)} bytes is not a whole number of int64",
                                field=where) from None
    array = np.asarray(value)
    if array.size == 0:
        return NO_VALUES
    if array.ndim != 1 or array.dtype.kind not in "iu":
        # Floats and bools would be cast silently; they are not counts.
        raise MalformedBody(f"{where}: expected a flat list of integers", field=where)
    if array.dtype != np.int64:
        if array.dtype.kind == "u" and array.max() > _INT64_MAX:
            raise MalformedBody(f"{where}: a value exceeds int64", field=where)
        array = array.astype(np.int64)
    return array


_INT64_MAX = int(np.iinfo(np.int64).max)


class _ArrayRecord:
    """Equality field by field, arrays compared element by element (a retried step's reply
    equals the first one).

    Records are not frozen dataclasses: their arrays could be written anyway, and a frozen
    constructor costs five plain ones, several times per step. Nothing changes a record once it
    is built."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name))
                   for f in fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


@dataclass(eq=False)
class StepCall(_ArrayRecord):
    """One scheduler step of one worker, every column an int64 array (see
    `protocol.StepRequest` for the meaning and order)."""

    worker_id: str
    session: int
    epoch: int
    step_id: int
    result_handles: np.ndarray
    num_accepted: np.ndarray
    revert_handles: np.ndarray
    finished_handles: np.ndarray
    grant_handles: np.ndarray
    draft_lens: np.ndarray
    padding_handles: np.ndarray
    padded_draft_lens: np.ndarray
    prefill_handles: np.ndarray
    prefill_tokens: np.ndarray
    new_req_ids: tuple[str, ...]
    prompt_lens: np.ndarray
    first_chunks: np.ndarray
    prompt_token_ids: np.ndarray

    @classmethod
    def from_wire(cls, message: Any) -> StepCall:
        """From a `wire.StepRequestBinary` (IPC) or `wire.StepRequest` struct or a validated
        `protocol.StepRequest` model: columns checked, lengths matched."""
        header = (message.worker_id, message.session, message.epoch, message.step_id)
        if isinstance(message, wire.StepRequestBinary):
            values, sizes = _unpacked(message, _REQUEST_PATHS)
            arrays = _split(values, sizes)
            _check_bounds(arrays)
            return cls._checked(*header, tuple(message.req_ids), arrays)
        return cls.build(*header, new_req_ids=tuple(message.new.req_ids),
                         **dict(zip(_REQUEST_COLUMNS, _request_columns(message), strict=True)))

    @classmethod
    def build(cls, worker_id: str, session: int, epoch: int, step_id: int, *,
              new_req_ids: Sequence[str] = (), **columns: ColumnInput) -> StepCall:
        """A call from columns given as sequences, arrays or int64 bytes (missing ones empty);
        `MalformedBody` naming the first bad element or mismatched length."""
        arrays = _converted(columns)
        _check_bounds(arrays)
        return cls._checked(worker_id, session, epoch, step_id, tuple(new_req_ids), arrays)

    @classmethod
    def _checked(cls, worker_id: str, session: int, epoch: int, step_id: int,
                 req_ids: tuple[str, ...], arrays: list[np.ndarray]) -> StepCall:
        """The call of columns already typed and within their bounds, once their lengths
        agree."""
        for group, first, second, i, j in _PAIRED:
            a, b = arrays[i], arrays[j]
            if a.size != b.size:
                raise MalformedBody(f"{group}.{second}: {b.size} values for {a.size} {first}",
                                    field=f"{group}.{second}")
        prompt_lens, first_chunks, prompt_ids = arrays[-3:]
        if prompt_lens.size != len(req_ids):
            raise MalformedBody(f"new.prompt_lens: {prompt_lens.size} values for "
                                f"{len(req_ids)} req_ids", field="new.prompt_lens")
        if first_chunks.size not in (0, len(req_ids)):
            raise MalformedBody(f"new.first_chunks: {first_chunks.size} values for "
                                f"{len(req_ids)} req_ids (give none or one each)",
                                field="new.first_chunks")
        if prompt_ids.size and prompt_ids.size != int(prompt_lens.sum()):
            raise MalformedBody(f"new.prompt_token_ids: {prompt_ids.size} ids "
                                f"for prompts of {int(prompt_lens.sum())} tokens "
                                "(give none or every one)", field="new.prompt_token_ids")
        return cls(worker_id, session, epoch, step_id, *arrays[:-3], req_ids, *arrays[-3:])

    def to_wire(self, binary: bool) -> Any:
        """As a `wire.StepRequestBinary` (IPC) or `wire.StepRequest` (REST JSON) struct."""
        if binary:
            return wire.StepRequestBinary(
                worker_id=self.worker_id, session=self.session, epoch=self.epoch,
                step_id=self.step_id, req_ids=list(self.new_req_ids),
                **_packed(_request_arrays(self)))
        groups: dict[str, dict[str, Any]] = {}
        for attr, (group, name) in _REQUEST_COLUMNS.items():
            groups.setdefault(group, {})[name] = getattr(self, attr).tolist()
        groups["new"]["req_ids"] = list(self.new_req_ids)
        return wire.StepRequest(
            worker_id=self.worker_id, session=self.session, epoch=self.epoch,
            step_id=self.step_id,
            **{group: wire.struct_for(_MODELS[group])(**columns)
               for group, columns in groups.items()})

    def entries(self) -> dict[str, int]:
        """Entries per list, for the service's batch limits."""
        return {"results": self.result_handles.size, "reverts": self.revert_handles.size,
                "finished": self.finished_handles.size, "grants": self.grant_handles.size,
                "padding": self.padding_handles.size, "prefill": self.prefill_handles.size,
                "new": len(self.new_req_ids)}


_MODELS: dict[str, type[BaseModel]] = {
    "results": protocol.ResultColumns, "reverts": protocol.HandleColumn,
    "finished": protocol.HandleColumn, "grants": protocol.GrantColumns,
    "padding": protocol.PaddingColumns, "prefill": protocol.PrefillColumns,
    "new": protocol.NewColumns,
}


@functools.cache
def _field_names(holder: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(holder))


class _Bounds(NamedTuple):
    """Per StepCall column, in `_REQUEST_COLUMNS` order: its name in errors
    (``grants.draft_lens``) and the bounds its `protocol.Column` declares."""

    names: tuple[str, ...]
    low: np.ndarray
    high: np.ndarray


@functools.cache
def _request_bounds() -> _Bounds:
    columns = [_bounds(_MODELS[group])[name] for group, name in _REQUEST_COLUMNS.values()]
    return _Bounds(_REQUEST_PATHS,
                   np.array([c.ge for c in columns], dtype=np.int64),
                   np.array([c.le for c in columns], dtype=np.int64))


_request_columns = operator.attrgetter(*_REQUEST_PATHS)
_request_arrays = operator.attrgetter(*_REQUEST_COLUMNS)
_COLUMN_AT = {attr: i for i, attr in enumerate(_REQUEST_COLUMNS)}


def _converted(columns: dict[str, ColumnInput]) -> list[np.ndarray]:
    """`StepCall.build`'s columns as arrays, in `_REQUEST_COLUMNS` order, converting the given
    ones only (a step gives a few): TypeError naming unknown columns, else `MalformedBody`
    naming the first bad element (an earlier column's value outside its bounds before a later
    column that does not convert)."""
    unknown = columns.keys() - _COLUMN_AT.keys()
    if unknown:
        raise TypeError(f"unknown columns: {sorted(unknown)}")
    arrays = [NO_VALUES] * len(_COLUMN_AT)
    for attr in sorted(columns, key=_COLUMN_AT.__getitem__):
        i = _COLUMN_AT[attr]
        try:
            arrays[i] = compiled_type(as_int64(columns[attr], _REQUEST_PATHS[i]))
        except MalformedBody:
            _check_bounds(arrays)  # the columns before this one, converted
            raise
    return arrays


def _unpacked(message: Any, paths: tuple[str, ...]) -> tuple[np.ndarray, list[int]]:
    """A packed message's ``columns`` as one int64 array, and its ``lengths``; `MalformedBody`
    if they do not describe ``paths`` columns exactly. The array is the one copy out of the
    message: its columns outlive the buffer the message was received in, and are writable (see
    NO_VALUES)."""
    lengths, data = message.lengths, message.columns
    if len(lengths) != len(paths):
        raise MalformedBody(f"lengths: {len(lengths)} lengths for the {len(paths)} columns "
                            f"({', '.join(paths)})", field="lengths")
    if len(data) != INT64.itemsize * sum(lengths):
        raise MalformedBody(f"columns: {len(data)} bytes, where lengths give "
                            f"{sum(lengths)} int64 values", field="columns")
    return np.frombuffer(data, dtype=INT64).copy(), lengths


def _packed(arrays: Sequence[np.ndarray]) -> dict[str, Any]:
    """``lengths`` and ``columns`` of a packed message holding ``arrays`` (ints), in order."""
    # Joined as bytes: one copy of each non-empty column, where a concatenation copies twice and
    # pays for every empty one (most of a step's columns are).
    return {"lengths": [a.size for a in arrays],
            "columns": b"".join([(a if a.dtype == INT64 else a.astype(INT64)).tobytes()
                                 for a in arrays if a.size])}


def _split(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive columns of ``sizes`` values (views; `NO_VALUES` for an
    empty one)."""
    return [column if column.size else NO_VALUES for column in views(values, sizes[:-1])]


def _check_bounds(arrays: list[np.ndarray]) -> None:
    """Columns (every one, in `_REQUEST_COLUMNS` order) within their bounds, in one pass;
    `MalformedBody` naming the first element outside."""
    names, low, high = _request_bounds()
    # A tuple of one array type: one compiled loop over the columns where they lie.
    column, i = first_outside(tuple(arrays), low, high)
    if column >= 0:
        raise MalformedBody(f"{names[column]}[{i}]: {int(arrays[column][i])} is outside "
                            f"[{low[column]}, {high[column]}]", field=f"{names[column]}[{i}]")


def first_outside_reference(columns: tuple[np.ndarray, ...], low: np.ndarray,
                            high: np.ndarray) -> tuple[int, int]:
    """The first value of ``columns`` outside its column's ``[low, high]``, as (column, index
    in it); (-1, -1) when there is none."""
    for column, values in enumerate(columns):
        outside = np.flatnonzero((values < low[column]) | (values > high[column]))
        if outside.size:
            return column, int(outside[0])
    return -1, -1


def _first_outside_loop(columns, low, high):  # type: ignore[no-untyped-def]  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    for column in range(len(columns)):
        values = columns[column]
        for i in range(values.size):
            if values[i] < low[column] or values[i] > high[column]:
                return column, i
    return -1, -1


first_outside = (jit(_first_outside_loop) if numba is not None
                 else first_outside_reference)


# ---------------------------------------------------------------- the reply


@dataclass(eq=False)
class Scheduled(_ArrayRecord):
    """This step's forward in token order (see `protocol.ScheduledColumns`)."""

    handles: np.ndarray
    rows: np.ndarray
    token_offsets: np.ndarray
    num_tokens: np.ndarray
    num_drafts: np.ndarray
    start_positions: np.ndarray

    def __len__(self) -> int:
        return int(self.handles.size)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per token of the step: the index of its request here, and its sequence position."""
        request = np.repeat(np.arange(len(self)), self.num_tokens)
        within = np.arange(request.size) - self.token_offsets[request]
        return request, self.start_positions[request] + within


_ONBOARDING = next(c for c, r in protocol.REFUSAL_REASONS.items() if r == "onboarding")


@dataclass(eq=False)
class Refused(_ArrayRecord):
    """Requests this step could not schedule (see `protocol.RefusedColumns`)."""

    kinds: np.ndarray
    indices: np.ndarray
    reasons: np.ndarray

    def __len__(self) -> int:
        return int(self.kinds.size)

    def of_kind(self, kind: str) -> np.ndarray:
        """Indices refused among the ``"grant"``, ``"prefill"`` or ``"new"`` entries."""
        code = {v: k for k, v in protocol.REFUSED_KINDS.items()}[kind]
        return self.indices[self.kinds == code]

    def onboarding(self) -> bool:
        """Whether a new request waits for its prefix to come back from the host tier (it is
        admitted when asked again, once it has)."""
        return bool((self.reasons == _ONBOARDING).any())


@dataclass(eq=False)
class TableChanges(_ArrayRecord):
    """Block-table changes for a worker that keeps its own copy of the table
    (`protocol.TableDeltas`)."""

    rows: np.ndarray
    starts: np.ndarray
    num_blocks: np.ndarray
    block_ids: np.ndarray

    def apply(self, table: np.ndarray) -> np.ndarray:
        """Bring a worker's own copy of the block table (rows x blocks, integers, -1 past each
        row's blocks as every table is) up to date; returns the flat indices of the cells it
        changed, for a device copy to follow."""
        changed = np.empty(int((table.shape[1] - self.starts).sum()), dtype=np.int64)
        n = apply_table_changes(table, self.rows, self.starts, self.num_blocks, self.block_ids,
                                changed)
        return changed[:n]


def apply_table_changes_reference(table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                                  num_blocks: np.ndarray, block_ids: np.ndarray,
                                  changed: np.ndarray) -> int:
    """`TableChanges.apply` over its columns: each changed row takes the next ``num_blocks -
    start`` of ``block_ids`` from column ``start`` on, and -1 past its ``num_blocks`` (up to
    its first -1: the table holds -1 past every row's blocks). Writes the flat index of each
    cell whose value changed into ``changed`` and returns how many."""
    width, offset, n = table.shape[1], 0, 0
    for row, start, count in zip(rows.tolist(), starts.tolist(), num_blocks.tolist(),
                                 strict=True):
        for column in range(start, width):
            value = block_ids[offset + column - start] if column < count else -1
            if column >= count and table[row, column] == -1:
                break
            if table[row, column] != value:
                table[row, column] = value
                changed[n] = row * width + column
                n += 1
        offset += count - start
    return n


def _apply_table_changes_loop(table, rows, starts, num_blocks,  # type: ignore[no-untyped-def]
                              block_ids, changed):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    width, offset, n = table.shape[1], 0, 0
    for i in range(rows.size):
        row, start, count = rows[i], starts[i], num_blocks[i]
        for column in range(start, width):
            if column < count:
                value = block_ids[offset + column - start]
            elif table[row, column] == -1:
                break
            else:
                value = -1
            if table[row, column] != value:
                table[row, column] = value
                changed[n] = row * width + column
                n += 1
        offset += count - start
    return n


# A Python loop over the changed rows otherwise: one per request that grew or shrank.
apply_table_changes = (jit(_apply_table_changes_loop) if numba is not None
                       else apply_table_changes_reference)


@dataclass(eq=False)
class StepResult(_ArrayRecord):
    """The reply to a `StepCall`, columns as int64 arrays."""

    epoch: int
    step_id: int
    admitted: np.ndarray  # per new request: its handle, -1 if refused
    scheduled: Scheduled
    refused: Refused
    committed: Any  # wire.CommitSummary
    free_blocks: int
    tables: TableChanges | None = None
    slot_mapping: np.ndarray | None = None
    # Per new request: prompt tokens already in the pool.
    cached_tokens: np.ndarray = field(default_factory=lambda: NO_VALUES)

    def to_wire(self, binary: bool) -> Any:
        """As a `wire.StepReplyBinary` (IPC) or `wire.StepReply` (REST JSON) struct."""
        slots = self.slot_mapping if self.slot_mapping is not None else NO_VALUES
        if binary:
            tables = self.tables if self.tables is not None else _NO_TABLES
            return wire.StepReplyBinary(
                epoch=self.epoch, step_id=self.step_id, committed=self.committed,
                free_blocks=self.free_blocks, with_tables=self.tables is not None,
                **_packed([self.admitted, *_scheduled_arrays(self.scheduled),
                           *_refused_arrays(self.refused), *_table_arrays(tables), slots,
                           self.cached_tokens]))

        def write(part: Any, model: type[BaseModel]) -> Any:
            return wire.struct_for(model)(
                **{f.name: getattr(part, f.name).tolist() for f in fields(part)})

        return wire.StepReply(
            epoch=self.epoch, step_id=self.step_id, admitted=self.admitted.tolist(),
            scheduled=write(self.scheduled, protocol.ScheduledColumns),
            refused=write(self.refused, protocol.RefusedColumns),
            committed=self.committed, free_blocks=self.free_blocks,
            tables=None if self.tables is None else write(self.tables, protocol.TableDeltas),
            slot_mapping=slots.tolist(), cached_tokens=self.cached_tokens.tolist())

    @classmethod
    def from_wire(cls, reply: Any) -> StepResult:
        """From either reply struct. ``tables`` and ``slot_mapping`` are None unless the worker
        keeps its own block table (``Registration.own_table``: the service sends tables exactly
        to those). Columns are typed, not range-checked: the service checked what it computed
        them from."""
        if isinstance(reply, wire.StepReplyBinary):
            c = _split(*_unpacked(reply, wire.column_paths(protocol.StepReply)))
            own = reply.with_tables
            return cls(epoch=reply.epoch, step_id=reply.step_id, admitted=c[0],
                       scheduled=Scheduled(*c[1:7]), refused=Refused(*c[7:10]),
                       committed=reply.committed, free_blocks=reply.free_blocks,
                       tables=TableChanges(*c[10:14]) if own else None,
                       slot_mapping=c[14] if own else None, cached_tokens=c[15])

        def read(part: Any, holder: type) -> Any:
            return holder(*[as_int64(getattr(part, name), name)
                            for name in _field_names(holder)])

        tables = None if reply.tables is None else read(reply.tables, TableChanges)
        return cls(
            epoch=reply.epoch, step_id=reply.step_id,
            admitted=as_int64(reply.admitted, "admitted"),
            scheduled=read(reply.scheduled, Scheduled), refused=read(reply.refused, Refused),
            committed=reply.committed, free_blocks=reply.free_blocks, tables=tables,
            slot_mapping=None if tables is None else as_int64(reply.slot_mapping,
                                                              "slot_mapping"),
            cached_tokens=as_int64(reply.cached_tokens, "cached_tokens"))


_scheduled_arrays = operator.attrgetter(*_field_names(Scheduled))
_refused_arrays = operator.attrgetter(*_field_names(Refused))
_table_arrays = operator.attrgetter(*_field_names(TableChanges))
_NO_TABLES = TableChanges(NO_VALUES, NO_VALUES, NO_VALUES, NO_VALUES)
