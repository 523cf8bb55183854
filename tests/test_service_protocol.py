"""The contract: the msgspec structs the core and IPC speak are the pydantic models REST validates
with, field for field, constraint for constraint, and both name a bad input the same way."""

from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import BaseModel, ValidationError

from server import protocol, wire
from server.errors import field_path
from server.operations import OPERATIONS

MODELS = [m for m in vars(protocol).values() if isinstance(m, type)
          and issubclass(m, protocol.Contract) and m is not protocol.Contract]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_model_has_a_struct_with_the_same_fields_and_defaults(model: type[BaseModel]) -> None:
    fields = msgspec.structs.fields(wire.struct_for(model))
    assert [f.name for f in fields] == list(model.model_fields)
    for f in fields:
        info = model.model_fields[f.name]
        assert f.required == info.is_required(), f.name
        if info.default_factory is not None:
            assert f.default_factory() == info.default_factory(), f.name
        elif not f.required:
            assert f.default == info.default, f.name


def test_every_operation_uses_derived_structs() -> None:
    for op in OPERATIONS.values():
        assert op.request.__module__ == op.reply.__module__ == wire.__name__


def test_a_struct_encoded_as_json_validates_as_its_model() -> None:
    step = wire.StepRequest(
        worker_id="w-1", epoch=7, step_id=3,
        results=[wire.Result(req_id="a", num_accepted=2)], reverts=["b"], finished=["c"],
        grants=[wire.Grant(req_id="a", draft_len=3)],
        padding=[wire.Padding(req_id="a", padded_draft_len=3)],
        prefill=[wire.PrefillChunk(req_id="d", num_tokens=5)],
        new=[wire.NewRequest(req_id="e", prompt_len=9, first_chunk=4)],
    )
    model = protocol.StepRequest.model_validate_json(wire.encode_json(step))
    assert wire.from_model(model, wire.StepRequest) == step
    assert wire.decode(wire.encode_msgpack(step), wire.StepRequest) == step


BAD_STEPS = [
    ({"grants": [{"req_id": "a", "draft_len": -1}]}, "grants[0].draft_len"),
    ({"new": [{"req_id": "a", "prompt_len": 0}]}, "new[0].prompt_len"),
    ({"results": [{"req_id": "", "num_accepted": 1}]}, "results[0].req_id"),
    ({"results": [{"num_accepted": 1}]}, "results[0].req_id"),
    ({"reverts": [3]}, "reverts[0]"),
    ({"worker_id": "has/slash"}, "worker_id"),
    ({"step_id": -1}, "step_id"),
    ({"epoch": "7"}, "epoch"),
    ({"surprise": 1}, "surprise"),
]


@pytest.mark.parametrize(("change", "field"), BAD_STEPS, ids=[f for _, f in BAD_STEPS])
def test_both_validators_refuse_the_same_input_and_name_the_same_field(
        change: dict[str, object], field: str) -> None:
    body = json.dumps({"worker_id": "w", "epoch": 1, "step_id": 0, **change}).encode()
    with pytest.raises(msgspec.ValidationError) as by_msgspec:
        wire.decode(body, wire.StepRequest, "json")
    with pytest.raises(ValidationError) as by_pydantic:
        protocol.StepRequest.model_validate_json(body)
    assert wire.error_field(by_msgspec.value) == field
    assert field_path(tuple(by_pydantic.value.errors()[0]["loc"])) == field
