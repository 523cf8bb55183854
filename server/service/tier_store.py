"""`TierStore`: the memory of the host tier for one pool shard, and the copies between the two.

The memory is block-major, ``[slots, L, P, T, H, D]``, where the pool is layer-major (``[L, P,
blocks, T, H, D]``, P planes: K and V, or one MLA latent): one block of the pool is ``P L`` pieces,
one slot of the tier is one piece. A copy gathers its blocks on the pool's device into a scratch
buffer of whole slots, so each slot crosses the link in one DMA (a run of consecutive slots in
one), at the link's speed instead of the speed of ``P L`` small copies. On a CUDA pool the memory
is pinned and the copies run on two streams of their own, one per direction:

- an offload waits for the service's stream (the commit that wrote its blocks), gathers, and
  lets the service's stream go on once the gather is done: from then on the pool's blocks may be
  rewritten, the DMA reads the scratch;
- an onboard copies into the scratch, scatters into its pool blocks, and the service's stream
  waits for it: everything the service does after (the commit, the step fence a worker's forward
  waits on) is ordered after the blocks landed, with no host synchronisation;
- a slot an onboard reads is never rewritten by an offload before the read is done, and a slot an
  offload writes is never read before it landed (each waits on the other's event when their
  slots meet); within one call, an offload that carries a block the onboard fills or rewrites a
  slot it reads follows the onboard, and otherwise the two are enqueued a chunk of each in turn,
  so that both directions of the link are busy from the start (one DMA per run of slots costs
  the host some microseconds: enqueued one direction after the other, a large onboard would keep
  the offload waiting for the host).

On a CPU pool the copies are plain tensor copies done before the call returns.

`copy_reference` is the plain statement of what a copy does (index by index); the tests hold the
gathered copies to it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch
from kvalloc.allocator import TierCopies
from kvalloc.allocator.common.device_io import current_stream, upload_int64

# Scratch for one direction's gather: large enough that a step's copies take one round.
SCRATCH_BYTES = 256 << 20
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def copy_reference(kv: torch.Tensor, memory: torch.Tensor, onboards: TierCopies,
                   offloads: TierCopies) -> None:
    """Onboards, then offloads, one block at a time."""
    for block, slot in zip(onboards.blocks.tolist(), onboards.slots.tolist(), strict=True):
        kv[:, :, block] = memory[slot]
    for block, slot in zip(offloads.blocks.tolist(), offloads.slots.tolist(), strict=True):
        memory[slot] = kv[:, :, block]


def runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """``slots`` cut into runs of consecutive values: (index of the run's first, its length, its
    first slot), as Python integers (each is a tensor slice of its own)."""
    if slots.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], cuts])
    return list(zip(starts.tolist(), np.diff(np.concatenate([starts, [slots.size]])).tolist(),
                    slots[starts].tolist(), strict=True))


def _meet(onboards: TierCopies, offloads: TierCopies) -> bool:
    """Whether an offload carries a block the onboard fills, or writes a slot it reads."""
    return bool(np.isin(offloads.blocks, onboards.blocks).any()
                or np.isin(offloads.slots, onboards.slots).any())


_DONE = object()


def _drain(*directions: Iterator[None] | None) -> None:
    """Run the chunked enqueues given to their ends, a chunk of each in turn."""
    left = [d for d in directions if d is not None]
    while left:
        left = [d for d in left if next(d, _DONE) is not _DONE]


class TierStore:
    def __init__(self, kv: torch.Tensor, num_slots: int) -> None:
        """The tier's memory for ``kv`` (a pool shard, ``[L, P, blocks, T, H, D]``)."""
        layers, planes, _, tpb, heads, dim = kv.shape
        # Copies move bytes: one integer type of the element's size indexes every dtype (fp8
        # included) the same way.
        self.kv = kv.view(_SAME_SIZE[kv.element_size()])
        self.cuda = kv.is_cuda
        # The pool with the block first: a gather or scatter of whole blocks is one pass.
        self.by_block = self.kv.permute(2, 0, 1, 3, 4, 5)
        self.memory = torch.empty((num_slots, layers, planes, tpb, heads, dim), dtype=self.kv.dtype,
                                  pin_memory=self.cuda)
        self.slot_bytes = self.memory[0].nbytes
        self.copy_seconds = 0.0
        if self.cuda:
            self._cuda = _CudaCopies(self, max(1, SCRATCH_BYTES // self.slot_bytes))

    def copy(self, onboards: TierCopies, offloads: TierCopies) -> None:
        """Carry out the copies a drain of the tier returned, onboards first."""
        if onboards.blocks.size == 0 and offloads.blocks.size == 0:
            return
        if self.cuda:
            self._cuda.copy(onboards, offloads)
            return
        start = time.perf_counter()
        on, off = onboards, offloads
        if on.blocks.size:
            slots = self.memory.index_select(0, torch.from_numpy(on.slots))
            self.by_block.index_copy_(0, torch.from_numpy(on.blocks), slots)
        if off.blocks.size:
            blocks = self.by_block.index_select(0, torch.from_numpy(off.blocks))
            self.memory.index_copy_(0, torch.from_numpy(off.slots), blocks)
        self.copy_seconds += time.perf_counter() - start


class _CudaCopies:
    """The two directions' streams, scratch buffers and events of a CUDA pool's tier."""

    def __init__(self, store: TierStore, scratch_slots: int) -> None:
        self.store = store
        device = self.device = store.kv.device
        # Each index upload is made once a call: an upload a chunk would allocate pinned memory
        # while the other direction's copies are queued, and such an allocation can wait.
        self.by_block = store.by_block
        self.scratch_slots = scratch_slots
        shape = (scratch_slots, *store.memory.shape[1:])
        self.streams = {d: torch.cuda.Stream(device) for d in ("on", "off")}
        self.scratch = {d: torch.empty(shape, dtype=store.kv.dtype, device=device)
                        for d in ("on", "off")}
        self.events: dict[str, torch.cuda.Event | None] = {"on": None, "off": None}
        self.busy: dict[str, set[int]] = {"on": set(), "off": set()}  # slots read / written
        self.timers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, onboards: TierCopies, offloads: TierCopies) -> None:
        self._harvest()
        current = current_stream(self.device.index)
        if offloads.blocks.size:
            # The commit that wrote the blocks, taken before the service's stream waits for this
            # call's onboard.
            self.streams["off"].wait_stream(current)
        on = self._onboard(onboards, current) if onboards.blocks.size else None
        off = self._offload(offloads, current) if offloads.blocks.size else None
        if on is None or off is None:
            _drain(on or off)
        elif _meet(onboards, offloads):  # the offload carries or rewrites what the onboard moves
            _drain(on)
            assert self.events["on"] is not None
            self.streams["off"].wait_event(self.events["on"])
            _drain(off)
        else:  # chunk by chunk in turn: the host feeds both directions of the link at once
            _drain(on, off)

    def _after(self, stream: torch.cuda.Stream, other: str, slots: np.ndarray) -> None:
        """``stream`` waits for the other direction's copies when they touch ``slots``."""
        event = self.events[other]
        if event is not None and self.busy[other] & set(slots.tolist()):
            stream.wait_event(event)

    def _timed(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start

    def _begin(self, direction: str, copies: TierCopies) -> tuple[
            torch.cuda.Stream, torch.cuda.Event, torch.Tensor]:
        """``direction``'s stream, after the other direction's copies of the same slots, with
        its timer started and the call's block indices uploaded on it."""
        stream = self.streams[direction]
        self._after(stream, "off" if direction == "on" else "on", copies.slots)
        with torch.cuda.stream(stream):
            return stream, self._timed(stream), upload_int64(copies.blocks, self.device)

    def _chunks(self, copies: TierCopies) -> Iterator[tuple[slice, np.ndarray]]:
        """The call's copies a scratch buffer at a time: their positions, and their slots."""
        for first in range(0, copies.blocks.size, self.scratch_slots):
            slots = copies.slots[first : first + self.scratch_slots]
            yield slice(first, first + slots.size), slots

    def _onboard(self, copies: TierCopies, current: torch.cuda.Stream) -> Iterator[None]:
        """Enqueues the onboard a chunk at a time, yielding between chunks."""
        scratch, memory = self.scratch["on"], self.store.memory
        self.streams["on"].wait_stream(current)  # the blocks were just handed out: nobody reads
        stream, start, blocks = self._begin("on", copies)
        for chunk, slots in self._chunks(copies):
            with torch.cuda.stream(stream):
                for at, n, slot in runs(slots):
                    scratch[at : at + n].copy_(memory[slot : slot + n], non_blocking=True)
                self.by_block.index_copy_(0, blocks[chunk], scratch[: slots.size])
            yield
        self.events["on"] = self._finish(stream, start, copies.slots, "on")
        current.wait_event(self.events["on"])

    def _offload(self, copies: TierCopies, current: torch.cuda.Stream) -> Iterator[None]:
        """Enqueues the offload a chunk at a time, yielding between chunks."""
        scratch, memory = self.scratch["off"], self.store.memory
        stream, start, blocks = self._begin("off", copies)
        gathered = torch.cuda.Event()
        for chunk, slots in self._chunks(copies):
            with torch.cuda.stream(stream):
                torch.index_select(self.by_block, 0, blocks[chunk], out=scratch[: slots.size])
                if chunk.stop >= copies.blocks.size:
                    gathered.record(stream)
                for at, n, slot in runs(slots):
                    memory[slot : slot + n].copy_(scratch[at : at + n], non_blocking=True)
            yield
        self.events["off"] = self._finish(stream, start, copies.slots, "off")
        current.wait_event(gathered)  # the pool's blocks may change once gathered

    def _finish(self, stream: torch.cuda.Stream, start: torch.cuda.Event, slots: np.ndarray,
                direction: str) -> torch.cuda.Event:
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self.busy[direction] |= set(slots.tolist())
        self.timers.append((start, end))
        return end

    def _harvest(self) -> None:
        """Add the copy time of the copies that finished; forget the slots of directions whose
        last copy is done."""
        done = [pair for pair in self.timers if pair[1].query()]
        for start, end in done:
            self.store.copy_seconds += start.elapsed_time(end) / 1e3
        self.timers = [pair for pair in self.timers if pair not in done]
        for direction, event in self.events.items():
            if event is not None and event.query():
                self.busy[direction].clear()
                self.events[direction] = None
