"""The contract: the msgspec structs the core and IPC speak are the pydantic models REST validates
with, field for field, constraint for constraint, and both name a bad input the same way."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.common.jit import numba
from kvalloc.server.contract import columns, protocol, wire
from kvalloc.server.contract.columns import Refused, Scheduled, StepCall, StepResult, TableChanges
from kvalloc.server.contract.errors import MalformedBody, field_path
from kvalloc.server.contract.operations import OPERATIONS
from pydantic import BaseModel, ValidationError

MODELS = [m for m in vars(protocol).values() if isinstance(m, type)
          and issubclass(m, protocol.Contract) and m is not protocol.Contract]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_model_has_a_struct_with_the_same_fields_and_defaults(
        model: type[BaseModel]) -> None:
    struct = wire.struct_for(model)
    fields = msgspec.structs.fields(struct)
    assert [f.name for f in fields] == list(model.model_fields)
    for f in fields:
        info = model.model_fields[f.name]
        assert f.required == info.is_required(), f.name
        if info.default_factory is not None:
            made, want = f.default_factory(), info.default_factory()
            if isinstance(want, BaseModel):
                assert list(msgspec.structs.asdict(made)) == list(type(want).model_fields)
            else:
                assert made == want, f.name
        elif not f.required:
            assert f.default == info.default, f.name


def test_every_operation_uses_derived_structs() -> None:
    for op in OPERATIONS.values():
        for binary in (False, True):
            assert (op.request_struct(binary).__module__ == op.reply_struct(binary).__module__
                    == wire.__name__)


def _call() -> StepCall:
    return StepCall.build(
        "w-1", session=5, epoch=7, step_id=3, result_handles=[1 << 20], num_accepted=[2],
        revert_handles=[2 << 20], finished_handles=[(3 << 20) | 1],
        grant_handles=[1 << 20], draft_lens=[3], padding_handles=[1 << 20],
        padded_draft_lens=[3], prefill_handles=[(1 << 20) | 4], prefill_tokens=[5],
        new_req_ids=["e", "f"], prompt_lens=[9, 2], first_chunks=[4, 0])


def test_a_call_round_trips_through_both_encodings_and_the_pydantic_model() -> None:
    call = _call()
    json_struct = call.to_wire(binary=False)
    model = protocol.StepRequest.model_validate_json(wire.encode_json(json_struct))
    assert StepCall.from_wire(model) == call
    assert StepCall.from_wire(wire.decode(wire.encode_json(json_struct), wire.StepRequest,
                                          "json")) == call
    binary = wire.encode_msgpack(call.to_wire(binary=True))
    assert StepCall.from_wire(wire.decode(binary, wire.StepRequestBinary)) == call


def test_ipc_columns_travel_packed_in_one_buffer_not_an_object_per_element() -> None:
    call = StepCall.build("w", 1, 1, 0, finished_handles=np.arange(1000) + (1 << 20),
                          grant_handles=[1 << 20], draft_lens=[2])
    decoded = msgspec.msgpack.decode(wire.encode_msgpack(call.to_wire(binary=True)))
    paths = wire.column_paths(protocol.StepRequest)
    assert isinstance(decoded["columns"], bytes) and len(decoded["columns"]) == 8 * 1002
    assert decoded["lengths"] == [{"finished.handles": 1000, "grants.handles": 1,
                                   "grants.draft_lens": 1}.get(p, 0) for p in paths]
    values = np.frombuffer(decoded["columns"], "<i8")
    assert np.array_equal(values[:1000], call.finished_handles)
    assert values[1000:].tolist() == [1 << 20, 2]


@pytest.mark.parametrize(("lengths", "data", "field"), [
    ([0] * 12, b"", "lengths"),  # one column short
    ([0] * 14, b"", "lengths"),
    ([1] + [0] * 12, b"", "columns"),  # a value the buffer lacks
    ([0] * 13, b"\0" * 8, "columns"),  # a value no length claims
    ([1] + [0] * 12, b"\0" * 7, "columns"),  # a torn value
])
def test_a_packed_request_whose_lengths_do_not_fit_its_buffer_is_named(
        lengths: list[int], data: bytes, field: str) -> None:
    message = wire.StepRequestBinary(worker_id="w", session=1, epoch=1, step_id=0,
                                     lengths=lengths, columns=data)
    with pytest.raises(MalformedBody) as err:
        StepCall.from_wire(message)
    assert err.value.field == field


def test_a_negative_length_is_refused_when_decoded() -> None:
    body = msgspec.msgpack.encode({"worker_id": "w", "session": 1, "epoch": 1, "step_id": 0,
                                   "lengths": [-1] + [0] * 12, "columns": b""})
    with pytest.raises(msgspec.ValidationError) as err:
        wire.decode(body, wire.StepRequestBinary)
    assert wire.error_field(err.value) == "lengths[0]"


def test_a_reply_round_trips_through_both_encodings() -> None:
    ints = [np.arange(n, dtype=np.int64) for n in (2, 3)]
    result = StepResult(
        epoch=1, step_id=2, admitted=np.array([5 << 20, -1]),
        scheduled=Scheduled(*[ints[0] + k for k in range(6)]),
        refused=Refused(np.array([2]), np.array([1]), np.array([2])),
        committed=wire.CommitSummary(tokens=4, written=3, fallback=None), free_blocks=9,
        tables=TableChanges(ints[0], ints[0], ints[0] + 1, ints[1]),
        slot_mapping=np.array([-1, 7, 8]))
    for binary, struct, fmt in ((True, wire.StepReplyBinary, "msgpack"),
                                (False, wire.StepReply, "json")):
        encode = wire.encode_msgpack if binary else wire.encode_json
        back = StepResult.from_wire(wire.decode(encode(result.to_wire(binary)), struct, fmt))
        assert back == result
    attached = StepResult(**{**result.__dict__, "tables": None, "slot_mapping": None})
    assert StepResult.from_wire(attached.to_wire(binary=True)) == attached


BAD_STEPS = [
    ({"grants": {"handles": [1], "draft_lens": [-1]}}, "grants.draft_lens[0]"),
    ({"new": {"req_ids": ["a"], "prompt_lens": [0]}}, "new.prompt_lens[0]"),
    ({"new": {"req_ids": [""], "prompt_lens": [1]}}, "new.req_ids[0]"),
    ({"results": {"num_accepted": [1.5]}}, "results.num_accepted[0]"),
    ({"reverts": {"handles": ["3"]}}, "reverts.handles[0]"),
    ({"reverts": [3]}, "reverts"),
    ({"worker_id": "has/slash"}, "worker_id"),
    ({"worker_id": "x\n"}, "worker_id"),
    ({"step_id": -1}, "step_id"),
    ({"step_id": 2**63}, "step_id"),
    ({"epoch": "7"}, "epoch"),
    ({"surprise": 1}, "surprise"),
]


@pytest.mark.parametrize(("change", "field"), BAD_STEPS, ids=[f for _, f in BAD_STEPS])
def test_both_validators_refuse_the_same_input_and_name_the_same_field(
        change: dict[str, object], field: str) -> None:
    body = json.dumps({"worker_id": "w", "session": 1, "epoch": 1, "step_id": 0,
                       **change}).encode()
    with pytest.raises(msgspec.ValidationError) as by_msgspec:
        wire.decode(body, wire.StepRequest, "json")
    with pytest.raises(ValidationError) as by_pydantic:
        protocol.StepRequest.model_validate_json(body)
    assert wire.error_field(by_msgspec.value) == field
    assert field_path(tuple(by_pydantic.value.errors()[0]["loc"])) == field


@pytest.mark.parametrize(("columns", "field"), [
    ({"draft_lens": b"\x01" * 7, "grant_handles": b""}, "grants.draft_lens"),
    ({"grant_handles": np.array([1 << 20]).tobytes(), "draft_lens": np.array([-2]).tobytes()},
     "grants.draft_lens[0]"),
    ({"prompt_lens": [3]}, "new.prompt_lens"),
    ({"finished_handles": [1.0]}, "finished.handles"),
    ({"finished_handles": [True]}, "finished.handles"),
    ({"finished_handles": [[1]]}, "finished.handles"),
])
def test_binary_and_array_columns_are_checked_with_the_same_bounds(
        columns: dict[str, object], field: str) -> None:
    with pytest.raises(MalformedBody) as err:
        StepCall.build("w", 1, 1, 0, **columns)  # type: ignore[arg-type]
    assert err.value.field == field


@pytest.mark.parametrize(("columns", "field"), [
    # Columns are checked in the request's order, each element by element.
    ({"result_handles": [1, 2], "num_accepted": [0, -1], "grant_handles": [1],
      "draft_lens": [-1]}, "results.num_accepted[1]"),
    ({"grant_handles": [1, 2, 3], "draft_lens": [0, 1, 1 << 40]}, "grants.draft_lens[2]"),
    # A value outside its bounds is named before a later column that is not integers at all...
    ({"result_handles": [1], "num_accepted": [-1], "finished_handles": [1.5]},
     "results.num_accepted[0]"),
    # ... and a column that is not integers before a later value outside its bounds.
    ({"result_handles": [1.5], "num_accepted": [-1]}, "results.handles"),
    ({"num_accepted": [-1], "result_handles": [1], "revert_handles": [1.5]},
     "results.num_accepted[0]"),
])
def test_the_first_bad_column_in_request_order_is_named(columns: dict[str, object],
                                                        field: str) -> None:
    with pytest.raises(MalformedBody) as err:
        StepCall.build("w", 1, 1, 0, **columns)  # type: ignore[arg-type]
    assert err.value.field == field


def test_an_unknown_column_is_named_before_any_bad_value() -> None:
    with pytest.raises(TypeError, match="unknown columns: \\['bogus'\\]"):
        StepCall.build("w", 1, 1, 0, finished_handles=[1.5], bogus=[1])  # type: ignore[arg-type]


def test_a_call_lists_its_columns_in_its_own_field_order_and_the_wire_order() -> None:
    names = [f.name for f in dataclasses.fields(StepCall)]
    assert [n for n in names if n not in ("worker_id", "session", "epoch", "step_id",
                                          "new_req_ids")] == list(columns._REQUEST_COLUMNS)
    assert names.index("new_req_ids") == names.index("prompt_lens") - 1
    assert wire.column_paths(protocol.StepRequest) == tuple(
        f"{group}.{name}" for group, name in columns._REQUEST_COLUMNS.values())


_CELL = st.integers(-2, 6) | st.sampled_from([2**31 - 1, 2**31, 2**62])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(columns._REQUEST_COLUMNS)),
                       st.lists(_CELL, max_size=4), max_size=6),
       st.integers(0, 2))
def test_a_packed_request_decodes_as_its_columns_build(given_columns: dict[str, list[int]],
                                                       new: int) -> None:
    """The IPC decoder (one buffer for every column) and `StepCall.build` (column by column)
    accept the same calls and name the same first bad element."""
    req_ids = [f"r{i}" for i in range(new)]
    arrays = [np.array(given_columns.get(attr, []), dtype=np.int64)
              for attr in columns._REQUEST_COLUMNS]
    message = wire.StepRequestBinary(
        worker_id="w", session=1, epoch=1, step_id=0, req_ids=req_ids,
        lengths=[a.size for a in arrays], columns=np.concatenate(arrays).tobytes())
    outcomes = []
    for decode in (lambda: StepCall.from_wire(message),
                   lambda: StepCall.build("w", 1, 1, 0, new_req_ids=req_ids, **given_columns)):
        try:
            outcomes.append(decode())
        except MalformedBody as exc:
            outcomes.append(exc.field)
    assert outcomes[0] == outcomes[1]
    if isinstance(outcomes[0], StepCall):
        assert StepCall.from_wire(wire.decode(wire.encode_msgpack(
            outcomes[0].to_wire(binary=True)), wire.StepRequestBinary)) == outcomes[0]


@pytest.mark.skipif(numba is None, reason="numba is not installed")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-3, 12), max_size=6), min_size=1, max_size=13),
       st.data())
def test_the_compiled_bounds_check_equals_the_reference(parts: list[list[int]],
                                                        data: st.DataObject) -> None:
    low = np.array(data.draw(st.lists(st.integers(-2, 5), min_size=13, max_size=13)))
    high = low + np.array(data.draw(st.lists(st.integers(0, 8), min_size=13, max_size=13)))
    given = tuple(np.array(part, dtype=np.int64) for part in parts)
    calls = given + (columns.NO_VALUES,) * (13 - len(given))  # a call has every column
    assert (columns.first_outside(calls, low, high)
            == columns.first_outside_reference(calls, low, high))


@pytest.mark.skipif(numba is None, reason="numba is not installed")
@settings(max_examples=200, deadline=None)
@given(st.sampled_from([np.int32, np.int64]), st.data())
def test_the_compiled_table_changes_equal_the_reference(dtype: type, data: st.DataObject) -> None:
    rows, width = 6, 5
    # Every table holds blocks from its released columns (-2) on and -1 past them.
    before = np.full((rows, width), -1, dtype=dtype)
    for row in range(rows):
        released, held = sorted(data.draw(st.lists(st.integers(0, width), min_size=2,
                                                   max_size=2)))
        before[row, :released] = -2
        before[row, released:held] = data.draw(st.lists(
            st.integers(0, 99), min_size=held - released, max_size=held - released))
    changed = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    spans = [sorted(data.draw(st.lists(st.integers(0, width), min_size=2, max_size=2)))
             for _ in changed]
    ids = np.arange(sum(count - start for start, count in spans), dtype=np.int64) + 1000
    args = [np.array(column, dtype=np.int64).reshape(-1)
            for column in (changed, [s for s, _ in spans], [c for _, c in spans])]
    want, got = before.copy(), before.copy()
    want_cells, got_cells = (np.empty(rows * width, dtype=np.int64) for _ in range(2))
    n = columns.apply_table_changes_reference(want, *args, ids, want_cells)
    assert columns.apply_table_changes(got, *args, ids, got_cells) == n
    assert np.array_equal(got, want) and np.array_equal(got_cells[:n], want_cells[:n])
    assert np.array_equal(np.sort(want_cells[:n]), np.flatnonzero(want != before))
    for row, (start, count) in zip(changed, spans, strict=True):  # what the reference states
        assert (want[row, count:] == -1).all() and np.array_equal(want[row, :start],
                                                                  before[row, :start])


def test_a_reply_of_other_integer_columns_packs_them_as_int64() -> None:
    empty = np.zeros(0, dtype=np.int32)
    result = StepResult(
        epoch=1, step_id=2, admitted=np.array([7, -1], dtype=np.int32),
        scheduled=Scheduled(*[np.array([k, 2 * k], dtype=np.int32) for k in range(6)]),
        refused=Refused(empty, empty, empty),
        committed=wire.CommitSummary(tokens=0, written=0, fallback=None), free_blocks=3,
        tables=None, slot_mapping=None)
    back = StepResult.from_wire(wire.decode(wire.encode_msgpack(result.to_wire(binary=True)),
                                            wire.StepReplyBinary))
    assert back == result
    assert back.admitted.dtype == np.int64 and back.refused.kinds is columns.NO_VALUES


def test_integer_bounds_are_integers_in_the_openapi_document() -> None:
    """JSON Schema readers must see 2**63 - 1 exactly, not a float that rounds to 2**63."""
    schema = protocol.StepRequest.model_json_schema()
    text = json.dumps(schema)
    assert "9223372036854775807" in text and "e+18" not in text


# A fresh process: other tests call the compiled loops with arrays of their own.
_STEPS_EVERY_WAY = '''
import json
import numpy as np
from numba.core.registry import CPUDispatcher
import kvalloc.allocator.capacity.step.compiled.driver, kvalloc.allocator.nwor.window_maths
import kvalloc.server.contract.columns
import kvalloc.server.service.batch, kvalloc.server.service.pipeline
import kvalloc.server.service.registry
from kvalloc.allocator import PoolConfig
from kvalloc.server.contract import wire
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

pool = PoolConfig(num_blocks=64, tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=8,
                  max_batch_size=8, max_seq_len=64, max_draft_len=3)
core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64))
kv = Client.in_process(core, worker_id="w")
kv.register()


def read_only(values):
    array = np.array(values, dtype=np.int64)
    array.flags.writeable = False
    return array


def sent(way, **columns):
    """A step built from ``columns``, then as IPC or REST would decode it."""
    reg = kv.registration
    call = StepCall.build("w", reg.session, reg.epoch, kv.next_step_id, **columns)
    if way == "ipc":
        call = StepCall.from_wire(wire.decode(wire.encode_msgpack(call.to_wire(True)),
                                              wire.StepRequestBinary))
    elif way == "rest":
        call = StepCall.from_wire(wire.decode(wire.encode_json(call.to_wire(False)),
                                              wire.StepRequest, "json"))
    return kv.send_step(call)


handles = kv.step(new=(["a", "b", "c"], [5, 9, 3])).admitted
kv.step(grants=(read_only(handles), np.array([3, 1, 3, 1, 3, 1], dtype=np.int64)[::2]))
for i, way in enumerate(("ipc", "rest", "in-process")):
    reply = sent(way, result_handles=handles, num_accepted=[i % 2, 1, 0],
                 grant_handles=handles, draft_lens=read_only([2, 2, 2]).tobytes(),
                 new_req_ids=[f"n{i}"], prompt_lens=[4])
    kv.step(results=(handles, [1, 1, 1]), grants=(handles, [1, 1, 1]), finished=reply.admitted)
kv.step(results=(handles, [0, 1, 1]), finished=handles)
core.check_invariants()
print(json.dumps({f"{module.__name__}.{name}": len(loop.signatures)
                  for module in (kvalloc.allocator.capacity.step.compiled.driver,
                                 kvalloc.allocator.nwor.window_maths,
                                 kvalloc.server.service.batch, kvalloc.server.contract.columns,
                                 kvalloc.server.service.pipeline,
                                 kvalloc.server.service.registry)
                  for name, loop in vars(module).items()
                  if isinstance(loop, CPUDispatcher) and loop.signatures}))
'''


@pytest.mark.skipif(numba is None, reason="numba is not installed")
def test_each_compiled_loop_of_the_step_compiles_once_however_the_call_was_built() -> None:
    # numba compiles a loop again for every new array type it meets (read-only, strided): a
    # step that met one would stall on the compile. Calls built from lists, read-only and
    # strided arrays and bytes, and decoded from IPC and REST, all reach the loops as one type.
    out = subprocess.run([sys.executable, "-c", _STEPS_EVERY_WAY], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    compiled = json.loads(out.splitlines()[-1])
    for loop in ("server.service.batch.settle_rows", "server.service.batch.mask_unowned_slots",
                 "server.service.pipeline.token_demand", "server.service.registry.live_rows",
                 "server.service.registry.take_rows", "server.service.batch._compiled_schedule",
                 "server.contract.columns.first_outside",
                 "allocator.capacity.step.compiled.driver._step"):
        loop = f"kvalloc.{loop}"
        assert loop in compiled, loop  # each ran
    assert {loop: n for loop, n in compiled.items() if n != 1} == {}


def _layout_fields(**extra: object) -> dict[str, object]:
    return {"num_blocks": 8, "tokens_per_block": 4, "num_layers": 2, "num_kv_heads": 1,
            "head_dim": 576, "dtype": "bfloat16", "staging_dtype": "bfloat16", "device": "cpu",
            "max_batch_size": 4, "max_blocks_per_seq": 2, "max_draft_len": 1,
            "max_step_tokens": 16, "overlap_scheduler": True, **extra}


def test_a_layout_without_kv_layout_reads_as_kv_and_latent_travels_both_ways() -> None:
    """A service that predates the field sends no kv_layout: its pool is per-head K and V."""
    old = _layout_fields()
    assert wire.decode(msgspec.msgpack.encode(old), wire.PoolLayout).kv_layout == "kv"
    assert protocol.PoolLayout.model_validate(old).kv_layout == "kv"
    latent = wire.PoolLayout(**_layout_fields(kv_layout="latent"))
    assert wire.decode(wire.encode_msgpack(latent), wire.PoolLayout).kv_layout == "latent"
    assert protocol.PoolLayout.model_validate_json(
        wire.encode_json(latent)).kv_layout == "latent"
    with pytest.raises(ValidationError) as info:
        protocol.PoolLayout.model_validate(_layout_fields(kv_layout="mla"))
    assert any("kv_layout" in e["loc"] for e in info.value.errors())
