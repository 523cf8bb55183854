"""docs/protocol.md's tables of the packed step are the code's columns: a client written in another
language from the tables alone packs and reads what the service does.

Each table lists, row by row, the columns of `wire.column_paths` of its message in that order,
each as the int64 little-endian the packing writes, with the bounds its `protocol.Column`
declares.
"""

from __future__ import annotations

import typing
from pathlib import Path

import numpy as np
import pytest
from kvalloc.server.contract import columns, protocol, wire
from pydantic import BaseModel

PROTOCOL_MD = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
SECTION = "### The packed step, column by column"
HEADER = "| # | column | type | bounds | meaning |"
MESSAGES = {"request": protocol.StepRequest, "reply": protocol.StepReply}
POWERS = {protocol.INT32_MAX: "2^31-1", protocol.INT63_MAX: "2^63-1"}


def documented_tables() -> dict[str, list[list[str]]]:
    """The section's tables in document order, as the request's and the reply's: rows of cells,
    backticks stripped."""
    text = PROTOCOL_MD.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ")]
    tables = []
    for block in section.split(HEADER)[1:]:
        rows = []
        for line in block.strip().splitlines()[1:]:  # past the |---| line
            if not line.startswith("|"):
                break
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
        tables.append(rows)
    assert len(tables) == len(MESSAGES), f"{SECTION}: one table per message"
    return dict(zip(MESSAGES, tables, strict=True))


def column(model: type[BaseModel], path: str) -> protocol.Column:
    """The `protocol.Column` of ``path`` (``grants.draft_lens``) in ``model``."""
    *groups, name = path.split(".")
    for group in groups:
        hint = typing.get_type_hints(model, include_extras=True)[group]
        model = next(t for t in (hint, *typing.get_args(hint))
                     if isinstance(t, type) and issubclass(t, BaseModel))
    found = wire.column_of(typing.get_type_hints(model, include_extras=True)[name])
    assert found is not None, path
    return found


def bounds(col: protocol.Column) -> str:
    return f"{POWERS.get(col.ge, col.ge)} .. {POWERS.get(col.le, col.le)}"


@pytest.mark.parametrize("message", MESSAGES)
def test_the_table_lists_every_column_in_wire_order(message):
    rows = documented_tables()[message]
    assert [row[1] for row in rows] == list(wire.column_paths(MESSAGES[message]))
    assert [row[0] for row in rows] == [str(i) for i in range(len(rows))]


@pytest.mark.parametrize("message", MESSAGES)
def test_each_column_has_the_packed_type_and_its_declared_bounds(message):
    assert np.dtype("<i8") == columns.INT64  # what "int64 LE" names
    for _, path, kind, documented, meaning in documented_tables()[message]:
        assert kind == "int64 LE", path
        assert documented == bounds(column(MESSAGES[message], path)), path
        assert meaning, f"{path}: no meaning given"
