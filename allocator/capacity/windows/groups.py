"""`KVCacheGroups`: one request, several KV cache groups, each with its own pool and table.

A model mixes layer kinds (full attention; sliding windows of W tokens): the layers of one kind
are a *group*, and each group gets its own `KVCacheManager` (its own block pool, block size and
block table, `PoolConfig.window` for a windowed one), so no group is padded to another's page size.
The driver applies one `StepPlan` to every group: rows, grants, results and chunks mean the same
request in each, and a request's capacity and history are the same in every group.

**One decision per request.** A grant, a prefill chunk or an admission happens only if every
group serves it. A group that served what another refused gives it back at once, exactly: a
grant by a revert (which undoes exactly what it added), an admission by freeing the row (in
reverse order, so every group's free-row stack is as before). A prefill chunk cannot be undone,
so a group that served it keeps it *ahead* (``ahead[row]``): the chunk is refused to the caller,
and when it comes again that group is asked only for what it has not served. A windowed group
keeps the window of such a chunk's start meanwhile (`WindowRelease.held_back`): the chunk runs
from there once every group has it.

**All or nothing.** A step either applies in every group or, with a typed error, changes none.
The groups' pools and rows differ (a request's chunk may be ahead in one group only), so an
error may be one group's alone: `OutOfBlocks` for padding or a strict grant, `PrefillIncomplete`
where only another group holds the whole prompt. Every group's plan is therefore checked
(`KVCacheManager.step_arrays` with ``apply`` False) before any group applies it. The check is
exact: it is the group's own step stopped before its first change, over the state that step
will find (no group's step reads another's state), so a plan every group passes runs in every
group, and the give-backs after it (a revert of a grant just made, a free of a row just
admitted) cannot fail. Undoing the groups that applied would not be exact: a settled result, a
finished row and a released window column have no inverse. The price: each group runs its
step's checks twice (the check, then the step's own).

**Prefix caching** (``prefix_caching=True``): every group keeps its own cache (its own block
size, so its own block hashes), and a new request is admitted with one hit in every group, the
longest every group serves (`hits.common_hit`: block-aligned in every group). Blocks register
only when the caller says their tokens are written (``mark_written``; each group's manager runs
with ``register_when_written``): a group may serve an admission or a chunk that another refuses,
and a block registered at scheduling would then be a hit for content no forward wrote (an
admission given back, a chunk held ahead until every group has it). The caller drains each
group's protection flips and events (``drain_cache_changes``).

**Placement**: every group's tensors are made by one `TensorAllocator`; the first group's keep
their own names (``block_table``, ``kv``), so a pool of one group is placed as a lone manager's,
and another group's are named ``group-<name>-<tensor>`` (`group_placement`), so a service can
export each group's table beside the first's.

Invariants (``check_invariants``): every group's own; the same live rows in every group, with
the same capacity and pending grants; a group's history is the common history plus its chunk
tokens ahead, and only a request still prefilling has tokens ahead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvalloc.allocator.capacity.block_table import BlockTable
from kvalloc.allocator.capacity.manager import KVCacheManager
from kvalloc.allocator.capacity.prefix_cache import CacheChanges, Prompt
from kvalloc.allocator.capacity.step.plan import (
    PlanArrays,
    RequestView,
    StepOutcome,
    StepPlan,
    coerce,
    prompt_token_arrays,
    with_changes,
)
from kvalloc.allocator.capacity.windows.hits import common_hit
from kvalloc.allocator.common.placement import TensorAllocator, plain_tensor
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import InvalidValue, InvariantViolation

# What must agree between groups for one row to mean one request in each.
_SHARED = ("max_batch_size", "max_seq_len", "max_draft_len", "overlap_scheduler",
           "slack_policy")


@dataclass(frozen=True)
class GroupSpec:
    """One group: its name and its pool (`PoolConfig`: blocks, block size, layers, heads, and
    ``window``, None for full attention)."""

    name: str
    config: PoolConfig


def group_tensor_name(specs: Sequence[GroupSpec], group: str, name: str) -> str:
    """The name group ``group``'s tensor ``name`` is made under: its own for the first group,
    ``group-<group>-<name>`` for another."""
    return name if group == specs[0].name else f"group-{group}-{name}"


def group_placement(specs: Sequence[GroupSpec], group: str,
                    allocate: TensorAllocator) -> TensorAllocator:
    """``allocate`` making group ``group``'s tensors under their `group_tensor_name`."""
    def named(name: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        return allocate(group_tensor_name(specs, group, name), shape, dtype, device)
    return named


@dataclass(frozen=True)
class GroupsOutcome:
    """What the step did to the request (``outcome``: grants, chunks and admissions every group
    served; block-table changes are the first group's) and each group's own outcome, with its
    block-table changes (``groups[name]``)."""

    outcome: StepOutcome
    groups: dict[str, StepOutcome]


class KVCacheGroups:
    def __init__(self, specs: Sequence[GroupSpec], *, allocate: TensorAllocator = plain_tensor,
                 compiled: bool | None = None, prefix_caching: bool = False,
                 cache_key: bytes = b"", hash_seed: bytes = b"") -> None:
        """``allocate``: where every group's table is made (`group_placement`).
        ``prefix_caching``: new requests admitted with their prompt token ids share cached
        blocks in every group, with one hit (``cache_key`` and ``hash_seed`` as
        `KVCacheManager`'s)."""
        if not specs:
            raise InvalidValue("groups: at least one group", field="groups")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise InvalidValue(f"groups: names repeat in {names}", field="groups")
        for spec in specs[1:]:
            for key in _SHARED:
                if getattr(spec.config, key) != getattr(specs[0].config, key):
                    raise InvalidValue(f"groups: {spec.name}'s {key} differs from "
                                       f"{specs[0].name}'s", field="groups")
        self.specs = tuple(specs)
        self.managers = {s.name: KVCacheManager(
            s.config, allocate=group_placement(specs, s.name, allocate), compiled=compiled,
            prefix_caching=prefix_caching, cache_key=cache_key, hash_seed=hash_seed,
            register_when_written=prefix_caching) for s in specs}
        self.prefix_caching = prefix_caching
        rows = specs[0].config.max_batch_size
        self.ahead = {s.name: np.zeros(rows, dtype=np.int64) for s in specs}

    @property
    def tables(self) -> dict[str, BlockTable]:
        """Each group's `BlockTable` (its device copy is what the group's layers read)."""
        return {name: m.table for name, m in self.managers.items()}

    def token_slots(self, rows: np.ndarray, starts: np.ndarray,
                    num_tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Each group's `KVCacheManager.token_slots` for the same runs (a windowed group's are -1
        behind its window)."""
        return {name: m.token_slots(rows, starts, num_tokens)
                for name, m in self.managers.items()}

    def view(self, row: int) -> dict[str, RequestView]:
        """Each group's `KVCacheManager.view` of live row ``row`` (its blocks are the group's;
        `UnknownRequest` naming ``row`` where it is not live)."""
        return {name: m.view(row) for name, m in self.managers.items()}

    @property
    def free_blocks(self) -> dict[str, int]:
        return {name: m.free_blocks for name, m in self.managers.items()}

    @property
    def live_rows(self) -> np.ndarray:
        """The live rows, the same in every group (`check_invariants`)."""
        return self.managers[self.specs[0].name].live_rows

    def step(self, plan: StepPlan) -> GroupsOutcome:
        """Apply ``plan`` to every group, or, with the typed error of the first group (in the
        order given) that refuses it, to none."""
        arrays = coerce(plan)
        return self.step_arrays(arrays, prompt_token_arrays(plan.prompt_tokens,
                                                            arrays.prompt_lens))

    def step_arrays(self, arrays: PlanArrays, tokens: Sequence[Any] = ()) -> GroupsOutcome:
        """`step` for a plan its caller already converted and checked (`coerce` or
        `plan.checked_plan`; ``tokens`` as `prompt_token_arrays` returns them), as
        `KVCacheManager.step_arrays` takes it."""
        plans = {name: self._chunks_left(name, arrays) for name in self.managers}
        prompts, hit = self._prompts(tokens, arrays.prompt_lens)
        for name, manager in self.managers.items():
            manager.step_arrays(plans[name], prompts[name], apply=False, hit_tokens=hit)
        runs: dict[str, StepOutcome] = {}
        chunk_starts = self._common_starts(arrays.prefill_rows)
        for name, manager in self.managers.items():
            if manager.window is not None:
                manager.window.held_back[:] = self.ahead[name]
            out = manager.step_arrays(plans[name], prompts[name], hit_tokens=hit)
            assert out is not None  # only a check returns None
            runs[name] = out
        for ahead in self.ahead.values():
            ahead[arrays.finished_rows] = 0
        chunk_ok = self._settle_chunks(arrays, runs)
        self._chunks_start_where_they_run(arrays, chunk_ok, chunk_starts)
        granted = np.logical_and.reduce([o.granted for o in runs.values()])
        admitted = np.logical_and.reduce([o.admitted_rows >= 0 for o in runs.values()])
        for name, out in runs.items():
            runs[name] = self._give_back(name, arrays, out, granted, admitted)
        first = runs[self.specs[0].name]
        refusals = np.max([o.new_refusals for o in runs.values()], axis=0).astype(np.int8)
        common = StepOutcome(
            granted=granted, prefill_granted=chunk_ok,
            admitted_rows=np.where(admitted, first.admitted_rows, -1), new_refusals=refusals,
            grant_starts=first.grant_starts, prefill_starts=chunk_starts,
            changed_rows=first.changed_rows, changed_from=first.changed_from,
            changed_num_blocks=first.changed_num_blocks,
            changed_block_ids=first.changed_block_ids, num_blocks=first.num_blocks,
            cached_tokens=np.where(admitted, first.cached_tokens, 0))
        return GroupsOutcome(common, runs)

    def prompt(self, tokens: np.ndarray, salt: bytes = b"") -> dict[str, Prompt]:
        """``tokens`` hashed once in each group's blocks (`KVCacheManager.prompt`), for
        `step_arrays`: hashing when a request arrives keeps it out of the step."""
        return {name: m.prompt(tokens, salt) for name, m in self.managers.items()}

    def _prompts(self, tokens: Sequence[Any], prompt_lens: np.ndarray
                 ) -> tuple[dict[str, list[Prompt | None]], np.ndarray | None]:
        """Each group's prompts (`prompt`'s, or a `Prompt` or bare token ids hashed here in its
        own blocks) and the hit every group serves each new request (None: no lookup)."""
        if not self.prefix_caching or all(t is None for t in tokens):
            return {name: [] for name in self.managers}, None
        prompts = {name: [_hashed(t, name, m) for t in tokens]
                   for name, m in self.managers.items()}
        hit = np.zeros(len(tokens), dtype=np.int64)
        for i in range(len(tokens)):
            if tokens[i] is not None:
                hit[i] = common_hit([(m.cache.servable(prompts[name][i], int(prompt_lens[i])),
                                      m.tokens_per_block) for name, m in self.managers.items()
                                     if m.cache is not None])
        return prompts, hit

    def mark_written(self, rows: np.ndarray, written_tokens: np.ndarray) -> None:
        """The first ``written_tokens[i]`` tokens of live row ``rows[i]`` are in every group's
        pool: their full prompt blocks become cached (`KVCacheManager.mark_written`)."""
        for manager in self.managers.values():
            manager.mark_written(rows, written_tokens)

    def drain_cache_changes(self) -> dict[str, CacheChanges]:
        """Each group's `KVCacheManager.drain_cache_changes` (with prefix caching the caller
        drains them, or the protection flips pile up)."""
        return {name: m.drain_cache_changes() for name, m in self.managers.items()}

    def _chunks_left(self, name: str, arrays: PlanArrays) -> PlanArrays:
        """The plan as group ``name`` sees it: each chunk less the tokens it already served."""
        ahead = self.ahead[name][arrays.prefill_rows]
        if not ahead.any():
            return arrays
        keep = arrays.prefill_tokens > ahead
        return arrays._replace(prefill_rows=arrays.prefill_rows[keep],
                               prefill_tokens=(arrays.prefill_tokens - ahead)[keep])

    def _settle_chunks(self, arrays: PlanArrays, runs: dict[str, StepOutcome]) -> np.ndarray:
        """A chunk is served when every group holds all of it; what a group served of a refused
        chunk stays ahead."""
        rows, tokens = arrays.prefill_rows, arrays.prefill_tokens
        held = {}
        for name, out in runs.items():
            ahead = self.ahead[name][rows]
            served = np.zeros(rows.size, dtype=np.int64)
            asked = tokens > ahead
            served[asked] = np.where(out.prefill_granted, (tokens - ahead)[asked], 0)
            held[name] = ahead + served
        ok = np.logical_and.reduce([h >= tokens for h in held.values()]) if held else \
            np.zeros(0, dtype=bool)
        for name, h in held.items():
            self.ahead[name][rows] = h - np.where(ok, tokens, 0)
        return ok

    def _common_starts(self, rows: np.ndarray) -> np.ndarray:
        """The common history of ``rows`` before a step: where their chunks start. The step
        leaves it there for a chunk it refuses (what a group served stays ahead) and moves it
        past one it serves, so it is the chunk's start after the step too."""
        name = self.specs[0].name
        return self.managers[name].rows.history[rows] - self.ahead[name][rows]

    def _chunks_start_where_they_run(self, arrays: PlanArrays, ok: np.ndarray,
                                     starts: np.ndarray) -> None:
        """A window that served a chunk ahead took its own history (or the end of what it held)
        for the chunk's start; the chunk runs from the common one, and at lag 2 the next step
        must keep that start readable while it may still run."""
        rows = arrays.prefill_rows[ok]
        for manager in self.managers.values():
            if manager.window is not None and rows.size:
                last = manager.window.last_start
                last[rows] = np.minimum(last[rows], starts[ok])

    def _give_back(self, name: str, arrays: PlanArrays, out: StepOutcome, granted: np.ndarray,
                   admitted: np.ndarray) -> StepOutcome:
        """Undo in group ``name`` what it served and another group refused."""
        reverts = arrays.grant_rows[out.granted & ~granted]
        frees = out.admitted_rows[(out.admitted_rows >= 0) & ~admitted][::-1]
        if reverts.size == 0 and frees.size == 0:
            return out
        manager = self.managers[name]
        # The undo is part of this scheduler step, not a step of the window's timeline: it may
        # release nothing (at lag 2 the previous step's chunk may still run and read from its
        # start, which the undo would take for history), and the previous step's start must
        # survive it. With every row's last start at its read_from, the undo's release keeps
        # read_from where this step left it.
        timeline = None if manager.window is None else manager.window.last_start.copy()
        if manager.window is not None:
            manager.window.last_start[:] = manager.window.read_from
        undo = manager.step(StepPlan(revert_rows=reverts, finished_rows=frees, lag=arrays.lag))
        if timeline is not None:
            manager.window.last_start[:] = np.where(manager.rows.live, timeline, 0)
        self.ahead[name][frees] = 0
        merged = dataclasses.replace(out, num_blocks=undo.num_blocks)
        return with_changes(merged, undo.changed_rows, undo.changed_from, undo.num_blocks,
                            manager.table.host)

    def check_invariants(self) -> None:
        lead = self.managers[self.specs[0].name]
        for name, manager in self.managers.items():
            manager.check_invariants()
            r, first = manager.rows, lead.rows
            if not np.array_equal(r.live, first.live):
                raise InvariantViolation(f"group {name} holds other rows than the first group")
            live = r.live
            if not (np.array_equal(r.capacity[live] - self.ahead[name][live],
                                   first.capacity[live] - self.ahead[self.specs[0].name][live])
                    and np.array_equal(r.pending, first.pending)
                    and np.array_equal(r.history - self.ahead[name],
                                       first.history - self.ahead[self.specs[0].name])):
                raise InvariantViolation(f"group {name}'s requests differ from the first group's")
            if self.ahead[name][~live].any() or (r.pending & (self.ahead[name] > 0)).any():
                raise InvariantViolation(f"group {name} holds chunk tokens ahead off a prefill")


def _hashed(tokens: Any, group: str, manager: KVCacheManager) -> Prompt | None:
    """One new request's prompt in ``group``'s blocks: from `KVCacheGroups.prompt`'s hashes,
    else hashed now (a `Prompt` under its own namespace)."""
    if tokens is None or isinstance(tokens, dict):
        return None if tokens is None else tokens[group]
    if isinstance(tokens, Prompt):
        return manager.prompt(tokens.tokens, salt=tokens.namespace)
    return manager.prompt(tokens)
