"""The compiled step's arguments as named tuples of arrays, and the indices into its arrays.

numba compiles a named tuple's field read to a struct read, so the phases read as `reference`'s,
which take the dataclasses these mirror: `Plan`, `Limits`, `Rows` and `Settled` have the fields
of `PlanArrays`, `StepLimits`, `RowState` and `reference.Settled`; `Pool`, `Table` and `State`
hold `CapacityState`'s arrays; `HitArrays`, `Demand` and `Served` are `Hits`,
`reference.Demand` and `reference.Served`; `Scratch` holds the working arrays a step reuses.

Invariants: `Plan`'s lists are all int64, in `PlanArrays`' order (so that `validate` indexes them
by subject code, `codes`); ``State.tops`` holds the stack tops the step moves (numba cannot
assign a tuple's field) at `NUM_FREE`, `NUM_FREE_ROWS` and `NUM_EVICTED`.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import fields
from typing import NamedTuple

import numpy as np
from kvalloc.allocator.capacity.state import COUNTER_INDEX, POLICY_CODES, RowState, StepLimits
from kvalloc.allocator.capacity.step import reference
from kvalloc.allocator.capacity.step.plan import PlanArrays
from kvalloc.allocator.config import SlackPolicy

RECLAIM = POLICY_CODES[SlackPolicy.RECLAIM]
COUNT_GRANTS = COUNTER_INDEX["grants"]
COUNT_REFUSED = COUNTER_INDEX["grants_refused"]
COUNT_REVERTS = COUNTER_INDEX["reverts"]
COUNT_UPDATES = COUNTER_INDEX["updates"]
COUNT_REWOUND = COUNTER_INDEX["rewound_tokens"]
COUNT_RECLAIMED = COUNTER_INDEX["reclaimed_slack_tokens"]
COUNT_TOPUPS = COUNTER_INDEX["padding_topups"]
COUNT_ADDED = COUNTER_INDEX["requests_added"]
COUNT_NOT_ADDED = COUNTER_INDEX["requests_refused"]
COUNT_FREED = COUNTER_INDEX["requests_freed"]
COUNT_EVICTED = COUNTER_INDEX["evicted_blocks"]

# `State.tops`: the stack tops the step moves (numba cannot assign a tuple's fields).
NUM_FREE = 0  # `BlockPool.num_free`
NUM_FREE_ROWS = 1  # `BlockTable.num_free_rows`
NUM_EVICTED = 2  # blocks this step evicted, in `Scratch.evicted`
# `BlockPool.lru`'s entries.
LRU_HEAD, LRU_TAIL, LRU_LENGTH = 0, 1, 2


# The named tuples the step's functions take (numba compiles a field read to a struct read).
# These four have the fields of `PlanArrays` (its lists: all int64, so that `validate` can index
# them by subject code), `StepLimits` (the policy as its code, `POLICY_CODES`), `RowState` and
# `reference.Settled` (in scratch arrays).
Plan = namedtuple("Plan", [name for name in PlanArrays._fields
                           if name not in ("strict_grants", "lag")])
Limits = namedtuple("Limits", [field.name for field in fields(StepLimits)])
Rows = namedtuple("Rows", [field.name for field in fields(RowState)])
Settled = namedtuple("Settled", [field.name for field in fields(reference.Settled)])


class Pool(NamedTuple):
    """`BlockPool`'s arrays (its ``num_free`` is ``State.tops[NUM_FREE]``)."""

    free_stack: np.ndarray
    refcounts: np.ndarray
    lru_prev: np.ndarray
    lru_next: np.ndarray
    lru: np.ndarray


class Table(NamedTuple):
    """`BlockTable`'s host arrays (its ``num_free_rows`` is ``State.tops[NUM_FREE_ROWS]``)."""

    host: np.ndarray
    free_rows: np.ndarray


class State(NamedTuple):
    """`CapacityState`, and the tops of its stacks (updated)."""

    limits: Limits
    rows: Rows
    pool: Pool
    table: Table
    tops: np.ndarray  # int64 [3]: NUM_FREE, NUM_FREE_ROWS, NUM_EVICTED


class Window(NamedTuple):
    """`WindowRelease`'s arrays (``size``: its window W, 0 for full attention, which releases
    nothing), and the release's working arrays per row: each row's step start (``starts``) and
    whether it was admitted in this step (``fresh``)."""

    size: int
    read_from: np.ndarray
    last_start: np.ndarray
    held_back: np.ndarray
    registering: np.ndarray
    keep_from: np.ndarray
    starts: np.ndarray
    fresh: np.ndarray


class HitArrays(NamedTuple):
    """`Hits`' arrays: one count per new request, their blocks concatenated, and the leading
    columns each hit starts released."""

    counts: np.ndarray
    blocks: np.ndarray
    released: np.ndarray


class Demand(NamedTuple):
    """`reference.Demand`; its arrays are `Scratch`'s, ``item_rows`` a view of its first ones."""

    item_rows: np.ndarray
    num_topups: int
    is_new_grant: np.ndarray
    wanted_draft: np.ndarray
    target_capacity: np.ndarray


class Served(NamedTuple):
    """`reference.Served` without ``admitted``, ``first_tokens``, ``hit_counts`` and
    ``hit_columns``: a new request is admitted where its refusal is 0, and `move._admit` works
    out the rest from the plan and hits."""

    item_ok: np.ndarray  # per row that grows (top-ups, grants, prefill chunks): a view of scratch
    granted: np.ndarray
    prefill_ok: np.ndarray
    refusals: np.ndarray
    grant_starts: np.ndarray
    prefill_starts: np.ndarray


class Scratch(NamedTuple):
    """The step's other working arrays, kept between steps (so a step allocates little). Per
    row: ``item_rows`` (`Demand`'s, then `serve_blocks` puts the prefill rows after them),
    ``is_new_grant``, ``wanted_draft``, ``target_capacity`` (`Demand`), ``item_ok`` (`Served`;
    top-ups, grants and prefill chunks name distinct rows, so they fit), ``seen`` (`validate`),
    ``rewritten`` (freed or admitted rows) and ``old_blocks`` (`move_blocks`),
    ``released_from`` (`release`: -1 where a row released nothing). Per block:
    ``claimed`` (`serve_hits_in_order`) and ``evicted`` (`block_moves.take`). ``seen`` and
    ``claimed`` are all False on entry and on return."""

    item_rows: np.ndarray
    is_new_grant: np.ndarray
    wanted_draft: np.ndarray
    target_capacity: np.ndarray
    item_ok: np.ndarray
    seen: np.ndarray
    claimed: np.ndarray
    rewritten: np.ndarray
    old_blocks: np.ndarray
    released_from: np.ndarray
    evicted: np.ndarray
