"""`DeviceStep`: one scheduler step's forward, verification and commit, launched on the device
without reading anything back.

The host hands over what it knows of the step (`LaunchPlan`, from the service's reply) in one
upload, and everything after it is device work (`DeviceStep._body`: the step's metadata, table
checks, drafts, forward, verification, commit), which a captured graph replays whole; the rest
of what the step needs comes from the device (`DeviceRows`): the token each decode feeds first, its
drafts when a device drafter makes them, and, behind a step the host has not read (an overlap
worker's), the lead its history starts after. Verification is greedy and on the device: a
decode accepts the longest prefix of its drafts that the model's own argmax agrees with, plus
the model's next token; the emitted tokens stop at the request's limit or a stop token. Each
step's outcome (`Launched`) is copied to pinned host memory behind an event, and the host reads
it when it needs it: at once in a synchronous worker, one step later in an overlap worker.

A decode-only step may run as more entries than the host planned: grown to its batch bucket
(`worker.step.batch_buckets`) by padded entries on the rows' spare row, so that a captured graph
serves it. The outcome and the record are the planned entries' alone.

Verification accepts through the library's rule (`allocator.nwor.acceptance.accept`), the one the
service's verify uses. An overlap worker also commits on the device, with the library's one
commit (`PackedCommit`, the service's too), right after verification and before the next forward
reads history, fenced by its session (nothing lands once the session ended). Each token's index
is its place in its entry, and an entry keeps ``1 + accepted`` tokens (a decode) or its whole
chunk (a prefill) while its request goes on, and nothing once the request ended, in this step or
before (a wasted forward), so the pool receives exactly what a synchronous service would have
committed.

A worker that keeps its own block table (`server.client.OwnTable`) sends the table's changes
since its last step in the same upload: the step scatters them into the table before anything
reads it (`TABLE_CELLS` of them at most, padded; more are uploaded on their own first), so that
bringing the table up to date costs no copy, replay or wait of its own between two forwards.

A grouped pool (`worker.step.pool_groups`) is the same step over several groups: one layout per
group (the entries shared, each group's own table), each layer read and staged through its own
group, one commit per group keeping the same tokens at the group's own slots.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from kvalloc.allocator import InvariantViolation, PackedCommit, TableValidator, accept
from kvalloc.allocator.common.device_io import PinnedUploads, current_stream
from kvalloc.server.client import OwnTable
from kvalloc.worker.attention.hook import PoolStep, StepGroup
from kvalloc.worker.attention.pool_attention import HostBounds, PagedLayout
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.step.batch_buckets import batch_bucket
from kvalloc.worker.step.decode_graphs import DecodeGraphs, Shape
from kvalloc.worker.step.pool_groups import PoolGroup, layer_places
from kvalloc.worker.step.rows import DeviceRows
from kvalloc.worker.step.step_metadata import (
    EntryColumns,
    GroupTable,
    StepMetadata,
    step_metadata,
)

# The most own-table cells a step carries in its upload (even: their int32 values pack two to an
# int64): a step's appends and a finished row's blocks or two, 1.5 KiB more to copy. A step
# that changed more uploads them on their own first; every padded cell is one more write of
# cell 0 in the scatter, which costs more device time than the copy.
TABLE_CELLS = 128


@dataclass(frozen=True)
class LaunchPlan:
    """A step as the host knows it: per entry of the reply (``[R]``) and per emitting entry
    (``[E]``: decodes, and prefill chunks that end their prompt, in entry order). Its derived
    columns are computed once (a launch reads each several times)."""

    rows: np.ndarray
    offsets: np.ndarray
    num_tokens: np.ndarray
    starts: np.ndarray
    behind: np.ndarray  # [R] 1 where the request has an unread step: its history starts later
    host_ids: np.ndarray  # [N]: prompt tokens, host drafts; 0 where the device fills in
    emitting: np.ndarray  # [E] entry indices
    decode: np.ndarray  # [E] bool: a decode (else a prompt's last chunk)
    drafts: np.ndarray  # [E] real drafts: a padded decode runs more tokens than it drafted

    @functools.cached_property
    def all_decodes(self) -> bool:
        """Every entry a decode (no prefill chunk)."""
        return self.decode.size == self.rows.size and bool(self.decode.all())

    @functools.cached_property
    def decode_only(self) -> bool:
        """Every entry a decode of one width: the shape a captured graph replays."""
        return self.all_decodes and bool((self.num_tokens == self.num_tokens[0]).all())

    @functools.cached_property
    def widths(self) -> np.ndarray:
        """Logits each emitting entry keeps: every token of a decode, a chunk's last."""
        return np.where(self.decode, self.num_tokens[self.emitting], 1)

    @classmethod
    def on_spare_row(cls, num_tokens: np.ndarray, row: int, *, decode: bool) -> LaunchPlan:
        """Entries of ``num_tokens`` each from position 0 on ``row`` (the spare row), every one
        emitting: decodes, or prompts' last chunks. Nothing of the pool is read and nothing is
        emitted or kept: a shape run before serving, or the padding of a batch bucket."""
        entries, zeros = num_tokens.size, np.zeros(num_tokens.size, dtype=np.int64)
        return cls(np.full(entries, row), np.cumsum(num_tokens) - num_tokens, num_tokens,
                   zeros, zeros, np.zeros(int(num_tokens.sum()), dtype=np.int64),
                   np.arange(entries), np.full(entries, decode), zeros)

    def then(self, other: LaunchPlan) -> LaunchPlan:
        """This plan's entries, then ``other``'s, packed after them."""
        tokens, entries = int(self.num_tokens.sum()), self.rows.size
        return LaunchPlan(*(np.concatenate(parts) for parts in (
            (self.rows, other.rows), (self.offsets, other.offsets + tokens),
            (self.num_tokens, other.num_tokens), (self.starts, other.starts),
            (self.behind, other.behind), (self.host_ids, other.host_ids),
            (self.emitting, other.emitting + entries), (self.decode, other.decode),
            (self.drafts, other.drafts))))

    def padded(self, entries: int, row: int) -> LaunchPlan:
        """This decode-only plan grown to ``entries`` entries by decodes of its width on ``row``
        (`on_spare_row`), after its own."""
        extra = entries - self.rows.size
        if extra <= 0:
            return self
        if not self.decode_only:
            raise InvariantViolation("padded: only a decode-only step grows to a bucket")
        return self.then(LaunchPlan.on_spare_row(np.full(extra, self.num_tokens[0]), row,
                                                 decode=True))

    @functools.cached_property
    def logit_rows(self) -> np.ndarray:
        """Packed index of every kept logit, in order."""
        ends = self.offsets[self.emitting] + self.num_tokens[self.emitting]
        return np.repeat(ends - self.widths, self.widths) + _ranges(self.widths)


@dataclass(frozen=True)
class Launched:
    """A step on its way: the host reads ``outcome()`` once ``done`` has passed. ``plan`` is
    the step as the host planned it; the device ran ``ran`` emitting entries, the padded ones
    last."""

    plan: LaunchPlan
    host: torch.Tensor  # int64, pinned on CUDA: [P * W] argmax, [P] emitted, [P] accepted
    outputs: StepOutputs
    ran: int  # P >= E
    done: torch.cuda.Event | None
    started: torch.cuda.Event | None  # the forward's first and last work, for idle time
    metadata_s: float  # host time to lay the step out and upload it

    def outcome(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens [E, W], emitted [E], accepted [E])``: entry e emitted ``tokens[e,
        :emitted[e]]``; waits for the device. Read once; later calls return the same arrays."""
        return self._settled

    @property
    def read(self) -> bool:
        """Whether `outcome` has been read (its pinned buffer may be taken again)."""
        return "_settled" in self.__dict__

    @functools.cached_property
    def _settled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.done is not None:
            self.done.synchronize()
        e, p, w = self.plan.emitting.size, self.ran, self.outputs.width
        # A copy: the pinned buffer is the device step's, taken again two launches later.
        flat = self.host.numpy().copy()
        return (flat[:p * w].reshape(p, w)[:e], flat[p * w:][:e], flat[p * w + p:][:e])

    @functools.cached_property
    def record(self) -> StepTensors:
        """What the step ran, the planned entries' part. A replayed step's tensors are its
        graph's static outputs, which the next replay of its shape overwrites: an observer
        reads them before the next launch."""
        plan, out = self.plan, self.outputs
        n, k = int(plan.num_tokens.sum()), int(plan.widths.sum())
        meta = out.meta
        return StepTensors(meta.ids[:n], meta.positions[:n], plan.logit_rows, out.logits[:k],
                           meta.slots[:, :n],
                           out.kept[:plan.rows.size] if out.kept is not None else None)


class StepOutputs(NamedTuple):
    """What a step's device work leaves for the host and observers."""

    packed: torch.Tensor  # int64 [E * W] argmax, [E] emitted, [E] accepted
    width: int  # W
    logits: torch.Tensor  # [K, vocab]
    kept: torch.Tensor | None  # [R] tokens each entry commits (an overlap worker's)
    meta: StepMetadata


@dataclass(frozen=True)
class StepTensors:
    """What the step ran, on the device, for observers (tests check the pool with it)."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    logit_rows: np.ndarray
    logits: torch.Tensor  # [K, vocab]
    slots: torch.Tensor  # [G, N]: each group's
    kept: torch.Tensor | None  # [R] tokens the worker's commit kept per entry (overlap only)


class DeviceStep:
    def __init__(self, model: torch.nn.Module, groups: Sequence[PoolGroup], rows: DeviceRows,
                 *, max_draft_len: int, stop_token_ids: frozenset[int],
                 drafter: DeviceOracleDrafter | None = None,
                 commits: Sequence[PackedCommit] = (),
                 validators: Sequence[TableValidator] = (),
                 graphs: DecodeGraphs | None = None, pad_batches: bool = False,
                 own_table: OwnTable | None = None) -> None:
        """``groups``: the pool's (`worker.step.pool_groups`; one for a pool of every layer),
        each layer read and staged through its own; ``commits`` and ``validators``: one per
        group, in group order (an overlap worker's own commits; --validate's checks).
        ``pad_batches``: run a decode-only step as its batch bucket
        (`worker.step.batch_buckets`), the shapes ``graphs`` capture; on with graphs.
        ``own_table``: the worker's own block table (the one group's), whose changes each
        launch from now on carries (`OwnTable.fold`)."""
        self.model, self.groups = model, tuple(groups)
        self.where = layer_places(self.groups)
        self.rows, self.max_draft_len = rows, max_draft_len
        self.drafter, self.commits, self.validators = drafter, tuple(commits), tuple(validators)
        self.graphs = graphs
        self.pad_batches = pad_batches or graphs is not None
        self.device = self.groups[0].kv.device
        self.stop = torch.tensor(sorted(stop_token_ids), dtype=torch.int64, device=self.device)
        self.timed = self.device.type == "cuda"
        # Two of each, taken in turn: the host fills one while the device may still copy from
        # the other (an overlap worker's previous step), so filling never waits for the device.
        # A replayed step's columns and every step's outcome travel through the pinned
        # buffers of its turn, which the turn's last step holds until it is read; the columns
        # of a step that runs eagerly, through the turn's uploads.
        self._uploads = (PinnedUploads(self.device), PinnedUploads(self.device))
        self._inputs, self._outputs = _PinnedTurns(), _PinnedTurns()
        self._holders: list[Launched | None] = [None, None]
        self._launches = 0
        self._tables = [GroupTable(g.block_table, g.tokens_per_block) for g in self.groups]
        self.own_table = own_table
        if own_table is not None:
            if len(self.groups) != 1:
                raise InvariantViolation("own_table: only a pool of one block table has one")
            own_table.fold()
        self._table_cells = TABLE_CELLS if own_table is not None else 0
        self._templates = _DecodeTemplates(rows.spare, self._table_cells)

    def launch(self, plan: LaunchPlan) -> Launched:
        # Looked up once, for the step's events and its upload.
        stream = current_stream(self.device.index) if self.timed else None
        started = self._event(stream)
        building = time.perf_counter()
        self._launches += 1
        turn = self._launches % 2
        self._free(turn)
        shape = self._shape(plan)
        static = self.graphs.static_columns(shape) if shape is not None else None
        if static is not None:  # a captured shape: its columns straight into the graph's
            self._upload_columns(turn, plan, shape, static)
            metadata_s = time.perf_counter() - building
            out, ran = self.graphs.replay(shape), shape[0]
        else:
            run = self._grown(plan)
            table = np.empty(self._table_cells * 3 // 2, dtype=np.int64)
            self._take_table(table)
            cols = _Columns.upload(run, table, self._table_cells, self._uploads[turn])
            metadata_s = time.perf_counter() - building
            out = (self.graphs.run_and_capture(shape, run, cols, self._body)
                   if shape is not None else self._body(run, cols))
            ran = run.emitting.size
        launched = Launched(plan, self._host_copy(turn, out.packed), out, ran,
                            self._event(stream), started, metadata_s)
        if self.timed:
            self._holders[turn] = launched
        return launched

    def _upload_columns(self, turn: int, plan: LaunchPlan, shape: Shape,
                        static: torch.Tensor) -> None:
        """A replayed step's columns into its graph's ``static`` copy: packed into ``turn``'s
        pinned buffer and copied behind the step on CUDA, packed in place on a CPU device."""
        if not self.timed:
            self._take_table(self._templates.pack_into(plan, shape, static.numpy()))
            return
        host = self._inputs.take(turn, static.numel())
        self._take_table(self._templates.pack_into(plan, shape, host.numpy()))
        static.copy_(host, non_blocking=True)

    def _take_table(self, segment: np.ndarray) -> None:
        """Write the own table's changes this step carries into ``segment``, the columns'
        last int64s (`_Columns.table_cells`, then ``table_values``), where they travel with
        the rest of the step's upload; nothing without an own table."""
        if self.own_table is not None:
            cells = self._table_cells
            self.own_table.take(segment[:cells], segment[cells:].view(np.int32))

    def flush_table(self) -> None:
        """Upload the own table's changes no launch carried (the last calls of a run)."""
        if self.own_table is not None:
            self.own_table.flush()

    def _free(self, turn: int) -> None:
        """Free ``turn``'s pinned buffers: its last step, if still unread (a caller further
        ahead; an overlap worker reads step k before it launches step k + 2), is read first,
        which waits for its device work and so for its copies in and out."""
        holder = self._holders[turn]
        if holder is not None and not holder.read:
            holder.outcome()
        self._holders[turn] = None

    def _host_copy(self, turn: int, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` where the host reads it: on CUDA a copy behind the step into ``turn``'s
        pinned buffer."""
        if not self.timed:
            return packed
        host = self._outputs.take(turn, packed.numel())
        host.copy_(packed, non_blocking=True)
        return host

    @property
    def capacity(self) -> int:
        """The most tokens a step packs: the staging buffer's rows."""
        return self.groups[0].staging.shape[2]

    def replays(self, plan: LaunchPlan) -> bool:
        """Whether launching ``plan`` now replays a captured graph (no capture, no eager run)."""
        shape = self._shape(plan)
        return shape is not None and self.graphs.captured_for(shape)

    def _shape(self, plan: LaunchPlan) -> Shape | None:
        """The shape a decode-only ``plan`` runs as with graphs (None without, or for a step
        that is not decode-only)."""
        if self.graphs is None or not plan.decode_only:
            return None
        width = int(plan.num_tokens[0])
        return self._entries_run(plan.rows.size, width), width

    def decode_shapes(self, widths: Iterable[int]) -> list[tuple[int, int]]:
        """``(entries, tokens each)``: each batch bucket at each of ``widths``. With
        ``pad_batches`` these are every shape a decode-only step runs as; without, they stand
        for the other batch sizes, which compile the same kernels (Triton specialises an
        integer only on being 1 or a multiple of 16)."""
        return [(entries, width) for width in widths
                for entries in sorted({batch_bucket(b, self._most_entries(width))
                                       for b in range(1, self._most_entries(width) + 1)})]

    def _grown(self, plan: LaunchPlan) -> LaunchPlan:
        """``plan`` as the device runs it: a decode-only step grown to its batch bucket."""
        if not plan.decode_only:
            return plan
        entries = self._entries_run(plan.rows.size, int(plan.num_tokens[0]))
        return plan.padded(entries, self.rows.spare)

    def _entries_run(self, entries: int, width: int) -> int:
        """The entries a decode-only step of ``entries`` runs as."""
        return batch_bucket(entries, self._most_entries(width)) if self.pad_batches else entries

    def _most_entries(self, width: int) -> int:
        """The most entries of ``width`` tokens a decode step runs: no more than the block
        table has rows, their tokens all in staging."""
        return min(self.rows.spare, self.capacity // width)

    def _body(self, plan: LaunchPlan, cols: _Columns) -> StepOutputs:
        """The step's device work from its uploaded columns: metadata, table checks, drafts,
        forward, verification and commit. Only device work, the same shapes for one plan
        shape, so that `DecodeGraphs` can capture it."""
        if cols.table_cells.numel():  # the own table's changes, before anything reads it
            self.groups[0].block_table.view(-1).index_copy_(
                0, cols.table_cells, cols.table_values.view(torch.int32))
        meta = step_metadata(
            EntryColumns(cols.rows, cols.offsets, cols.starts, cols.behind, cols.decoding,
                         cols.token_entry, cols.host_ids),
            self.rows.lead, self.rows.pending, self._tables)
        layouts = self._layouts(plan, cols, meta)
        for validator, layout in zip(self.validators, layouts, strict=False):  # none or each
            validator.check(layout.block_table, layout.rows, layout.history,
                            layout.history + layout.query_lens, layout.tokens_per_block)
        self._draft(plan, meta.ids, cols)
        step = PoolStep(tuple(StepGroup(g.kv, g.staging, layout)
                              for g, layout in zip(self.groups, layouts, strict=True)),
                        self.where)
        with torch.inference_mode():
            logits = self.model(
                input_ids=meta.ids[None], position_ids=meta.positions[None], use_cache=False,
                logits_to_keep=cols.logit_rows, kvalloc_step=step).logits[0]
            tokens, emitted, accepted, kept = self._verify(plan, layouts[0], meta.ids,
                                                           logits.argmax(-1), cols)
            # Every group keeps the same tokens of each entry, each at its own slots.
            for commit, slots in zip(self.commits, meta.slots, strict=False):
                commit.commit(slots, meta.index, cols.token_entry, kept, layouts[0].query_lens)
            packed = torch.cat([tokens.flatten(), emitted, accepted])
        return StepOutputs(packed, tokens.shape[1], logits, kept if self.commits else None,
                           meta)

    def _layouts(self, plan: LaunchPlan, cols: _Columns,
                 meta: StepMetadata) -> tuple[PagedLayout, ...]:
        """The step's entries through each group's table, in group order. The host bounds each
        history by the most a lead can be."""
        reach = plan.starts + plan.behind * self.max_draft_len + plan.num_tokens
        first = self.groups[0]
        layout = PagedLayout(first.block_table, first.tokens_per_block, cols.rows, cols.offsets,
                             cols.num_tokens, meta.history, cols.token_entry,
                             HostBounds(plan.num_tokens, reach, 1 + self.max_draft_len))
        return group_layouts(layout, self.groups)

    def _event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event recorded on ``stream`` (CUDA; None elsewhere)."""
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _draft(self, plan: LaunchPlan, ids: torch.Tensor, cols: _Columns) -> None:
        """A device drafter's drafts into each decode's tokens after its first."""
        width = int(plan.widths[plan.decode].max()) - 1 if plan.decode.any() else 0
        if self.drafter is None or width <= 0:
            return
        first = cols.offsets[cols.decodes]
        drafts = self.drafter.draft(self.rows.truth, cols.rows[cols.decodes],
                                    self.rows.generated, width)
        i = torch.arange(width, device=self.device)
        real = i[None, :] < cols.num_tokens[cols.decodes][:, None] - 1
        # Padded drafts land on one spare slot past the ids: a boolean mask would make the
        # host wait for the device to learn how many are real.
        spare = ids.numel()
        padded = torch.cat([ids, ids.new_zeros(1)])
        padded[torch.where(real, first[:, None] + 1 + i, spare)] = drafts
        ids.copy_(padded[:spare])

    def _verify(self, plan: LaunchPlan, layout: PagedLayout, ids: torch.Tensor,
                guesses: torch.Tensor, cols: _Columns) -> tuple[torch.Tensor, ...]:
        """Greedy acceptance and the rows' new state; returns ``(tokens [E, W], emitted [E],
        accepted [E], kept [R])``."""
        state, e, w = self.rows, cols.emitting, cols.widths
        width = int(plan.widths.max()) if plan.emitting.size else 1
        i = torch.arange(width, device=self.device)
        logit_start = torch.cumsum(w, 0) - w
        tokens = guesses[(logit_start[:, None] + i).clamp(max=max(guesses.numel() - 1, 0))]
        draft_at = (layout.query_starts[e][:, None] + 1 + i[:-1]).clamp(max=ids.numel() - 1)
        accepted = accept(ids[draft_at], tokens, cols.drafts)[1]  # the library's one rule
        rows = layout.rows[e]
        alive = state.alive[rows]
        emitted = torch.minimum(accepted + 1, state.limit[rows] - state.generated[rows])
        stops = torch.isin(tokens, self.stop) & (i < emitted[:, None])
        stopped = stops.any(1)
        emitted = torch.where(stopped, stops.long().argmax(1) + 1, emitted)
        emitted = torch.where(alive, emitted, 0)
        ended = alive & (stopped | (state.generated[rows] + emitted >= state.limit[rows]))
        picked = tokens.gather(1, accepted[:, None])[:, 0]
        state.pending[rows] = torch.where(alive, picked, state.pending[rows])
        state.generated[rows] += emitted
        state.alive[rows] = alive & ~ended
        state.lead[rows] = accepted
        kept = torch.where(state.alive[layout.rows], layout.query_lens, 0)
        kept[e] = torch.where(cols.decode.bool(), torch.where(alive & ~ended, accepted + 1, 0),
                              kept[e])
        return tokens, emitted, accepted, kept


class _Columns(NamedTuple):
    """A `LaunchPlan`'s columns on the device, from one upload (views of one tensor): per entry
    ``rows, offsets, num_tokens, starts, behind, decoding``, per token ``token_entry,
    host_ids``, the kept logits' ``logit_rows``, per emitting entry ``emitting, widths, decode,
    drafts``, ``decodes`` (the entries that decode), and an own table's ``table_cells`` and
    ``table_values`` (`DeviceStep._take_table`, none without; the int32 values two to an
    int64, viewed as int32 where read)."""

    rows: torch.Tensor
    offsets: torch.Tensor
    num_tokens: torch.Tensor
    starts: torch.Tensor
    behind: torch.Tensor
    decoding: torch.Tensor
    token_entry: torch.Tensor
    host_ids: torch.Tensor
    logit_rows: torch.Tensor
    emitting: torch.Tensor
    widths: torch.Tensor
    decode: torch.Tensor
    drafts: torch.Tensor
    decodes: torch.Tensor
    table_cells: torch.Tensor
    table_values: torch.Tensor

    flat: torch.Tensor  # the one tensor the others view

    @staticmethod
    def pack(plan: LaunchPlan, table: np.ndarray) -> np.ndarray:
        """The columns' values, one after the other in field order (``flat``'s layout);
        ``table``: the own table's cells then values (`DeviceStep._take_table`)."""
        decoding = np.zeros(plan.rows.size, dtype=np.int64)
        decodes = plan.emitting[plan.decode]
        decoding[decodes] = 1
        return np.concatenate([
            plan.rows, plan.offsets, plan.num_tokens, plan.starts, plan.behind, decoding,
            np.repeat(np.arange(plan.rows.size), plan.num_tokens), plan.host_ids,
            plan.logit_rows, plan.emitting, plan.widths, plan.decode, plan.drafts,
            decodes, table]).astype(np.int64, copy=False)

    @staticmethod
    def places(plan: LaunchPlan, table_cells: int) -> dict[str, int]:
        """Where each column starts in `pack`'s layout, and ``"end"``."""
        r, n, e = plan.rows.size, plan.host_ids.size, plan.emitting.size
        sizes = (r, r, r, r, r, r, n, n, plan.logit_rows.size, e, e, e, e,
                 int(plan.decode.sum()), table_cells, table_cells // 2)
        ends = np.cumsum(sizes).tolist()
        return {**{name: end - size for name, size, end in zip(
            _Columns._fields[:-1], sizes, ends, strict=True)}, "end": ends[-1]}

    @classmethod
    def upload(cls, plan: LaunchPlan, table: np.ndarray, table_cells: int,
               uploads: PinnedUploads) -> _Columns:
        """The columns through ``uploads``: valid until its next upload, in stream order;
        ``table``: ``table_cells`` own-table changes."""
        (flat,) = uploads.upload(cls.pack(plan, table))
        bounds = list(cls.places(plan, table_cells).values())
        return cls(*(flat[a:b] for a, b in itertools.pairwise(bounds)), flat)

    def over(self, flat: torch.Tensor) -> _Columns:
        """The same columns as views of ``flat`` (a copy of this ``flat``): laid out one after
        the other in field order, as `upload` packs them."""
        views, start = [], 0
        for column in self[:-1]:
            views.append(flat[start:start + column.numel()])
            start += column.numel()
        return _Columns(*views, flat)


class _DecodeTemplates:
    """`_Columns.pack` of a decode-only plan grown to its shape, from the shape's fixed values.
    Two steps of one shape differ only in their planned entries' rows, starts, behinds, host
    ids and drafts: the rest, and the padded entries' values, are those of the shape run on
    the spare row (`LaunchPlan.on_spare_row`), packed once per shape."""

    VARYING = ("rows", "starts", "behind", "host_ids", "drafts")

    def __init__(self, spare: int, table_cells: int) -> None:
        self.spare, self.table_cells = spare, table_cells
        self._shapes: dict[Shape, tuple[np.ndarray, dict[str, int]]] = {}

    def pack_into(self, plan: LaunchPlan, shape: Shape, out: np.ndarray) -> np.ndarray:
        """``out[:] = _Columns.pack(plan.padded(*shape), table)`` for a decode-only ``plan``
        of ``shape``'s width and at most its entries (``out``: int64, that long), but for
        the own table's changes: ``out``'s segment for them is returned, for the caller to
        write ``table`` into in place."""
        known = self._shapes.get(shape)
        if known is None:
            entries, width = shape
            spare = LaunchPlan.on_spare_row(np.full(entries, width), self.spare, decode=True)
            known = self._shapes[shape] = (
                _Columns.pack(spare, np.zeros(self.table_cells * 3 // 2, dtype=np.int64)),
                _Columns.places(spare, self.table_cells))
        template, places = known
        out[:] = template
        for name in self.VARYING:
            values = getattr(plan, name)
            out[places[name]:places[name] + values.size] = values
        return out[places["table_cells"]:places["end"]]


class _PinnedTurns:
    """Pinned int64 buffers, one per turn, each grown (to twice its size at least) when a
    step needs more. A buffer is free once its turn's last step has been read."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, turn: int, numel: int) -> torch.Tensor:
        """The first ``numel`` values of ``turn``'s buffer."""
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[turn] = torch.empty(
                max(numel, 2 * (buffer.numel() if buffer is not None else 0)),
                dtype=torch.int64, pin_memory=True)
        return buffer[:numel]


def group_layouts(layout: PagedLayout, groups: Sequence[PoolGroup]) -> tuple[PagedLayout, ...]:
    """``layout``'s entries through each group's table, in group order (the first group's is
    ``layout``)."""
    return (layout, *(layout.over(g.block_table, g.tokens_per_block) for g in groups[1:]))


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``[0 .. lengths[0]), [0 .. lengths[1]), ...`` concatenated."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
