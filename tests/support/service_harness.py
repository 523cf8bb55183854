"""Proving the NWOR contract through the service: what a worker stages, and what the pool must hold.

A test (or a smoke check on a new host) fills the pool with a poison value, runs steps whose
forward stages a recognisable pattern with `stage_pattern`, and then asks `pool_mismatches` whether
the pool holds exactly the committed tokens (`committed_slots`) and poison everywhere else.
`nwor_scenario` is that check as one multi-request scenario, over any `Client`.

Pattern: token ``i`` of the step tagged ``tag`` carries ``(tag, i, P * layer + plane)`` in the
first three elements of every head and 0 after them (P planes: 2, K and V, or 1, a latent); all
values are small integers, exact in bf16/fp16.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult


def stage_pattern(staging: torch.Tensor, num_tokens: int, tag: int) -> None:
    """The worker's forward: write the pattern of ``num_tokens`` tokens into ``staging``
    (``[num_layers, P, max_step_tokens, H, D]``)."""
    layers, planes = staging.shape[:2]
    step = staging[:, :, :num_tokens]
    step.zero_()
    step[..., 0] = tag
    step[..., 1] = torch.arange(num_tokens, device=staging.device, dtype=staging.dtype)[:, None]
    step[..., 2] = torch.arange(planes * layers, device=staging.device,
                                dtype=staging.dtype).view(layers, planes, 1, 1)


def committed_slots(reply: StepResult, slots: np.ndarray, tag: int,
                    accepted: Mapping[int, int], dropped: Collection[int] = ()
                    ) -> dict[int, tuple[int, int]]:
    """slot -> (tag, token index) for the tokens of ``reply``'s step that the next call commits:
    every non-draft token and the first ``accepted[handle]`` drafts, none of a ``dropped``
    request (reverted or finished). ``slots`` is the step's slot mapping (-1: a token no slot
    holds, behind a windowed group's window)."""
    out: dict[int, tuple[int, int]] = {}
    s = reply.scheduled
    for handle, offset, n, drafts in zip(s.handles.tolist(), s.token_offsets.tolist(),
                                         s.num_tokens.tolist(), s.num_drafts.tolist(),
                                         strict=True):
        if handle in dropped:
            continue
        keep = n - drafts + accepted.get(handle, 0)
        for i in range(offset, offset + keep):
            if slots[i] >= 0:
                out[int(slots[i])] = (tag, i)
    return out


def pool_mismatches(kv: torch.Tensor, expected: Mapping[int, tuple[int, int]],
                    poison: float, limit: int = 10) -> list[str]:
    """Where ``kv`` (``[L, P, num_blocks, tokens_per_block, H, D]``) differs from "exactly
    ``expected`` written, ``poison`` (NaN too) everywhere else"; empty when it holds exactly
    that."""
    layers, planes, blocks, tpb, heads, dim = kv.shape
    pool = kv.reshape(layers, planes, blocks * tpb, heads, dim).float().cpu()
    want = torch.full_like(pool, poison)
    if expected:
        slots = torch.tensor(list(expected), dtype=torch.int64)
        tags, tokens = (torch.tensor(v, dtype=torch.float32) for v in zip(*expected.values(),
                                                                           strict=True))
        want[:, :, slots] = 0.0
        want[:, :, slots, :, 0] = tags[:, None]
        want[:, :, slots, :, 1] = tokens[:, None]
        want[:, :, slots, :, 2] = torch.arange(planes * layers, dtype=torch.float32).view(
            layers, planes, 1, 1)
    differs = (pool != want) & ~(pool.isnan() & want.isnan())
    bad = differs.any(dim=-1).any(dim=-1).nonzero().tolist()
    return [f"layer {layer} {'KV'[k]} slot {s}: {pool[layer, k, s, 0, :3].tolist()} != "
            f"{want[layer, k, s, 0, :3].tolist()}" for layer, k, s in bad[:limit]]


def replayed_events(replay: zmq.Socket) -> list[dict]:
    """Every KV event a service published from the start, asked for on its replay socket
    (``replay``, a connected DEALER)."""
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    assert replay.poll(5000)
    events: list[dict] = []
    while True:
        _, seq, payload = replay.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return events
        events += msgspec.msgpack.decode(payload)[1]


POISON = -3.0
TTL = 10.0  # the lease of a core made for a test


class FakeClock:
    """A service core's clock that only the test moves (``now``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class NworOutcome:
    mismatches: list[str]  # empty: the pool holds exactly the committed tokens
    commit: wire.CommitSummary  # what the settling call reported


def nwor_scenario(client: Client, slow_forward: Callable[[], None] | None = None,
                  poison: float = POISON) -> NworOutcome:
    """The NWOR contract through a registered, attached ``client``, in three steps:

    1. admit a (6 tokens), b (3), c (9, first chunk 5) and d (4): one multi-request prefill;
    2. decode a (3 drafts), b (2), d (1) and prefill c's last 4 tokens, which commits step 1;
    3. settle: a accepted 1 draft, b all 2, d's forward was skipped (revert), c finished.

    Each forward stages `stage_pattern` (after ``slow_forward``, e.g. a long device sleep that
    proves the service waits for the forward). The pool is poisoned first; afterwards it must hold
    step 1's tokens, a's token and first draft, b's token and drafts, and poison everywhere else.
    A tensor-parallel pool's forward stages every shard, and every shard must hold that; a
    grouped pool's stages every group, and each group's pool must hold that at the slots of its
    own block table.
    """
    pool = client.pool
    assert pool is not None, "register() with attach first"
    parts = pool.shards or pool.groups or [pool]
    for part in parts:
        part.kv.fill_(poison)

    def forward(reply: StepResult, tag: int) -> list[np.ndarray]:
        """Stage the step's pattern; returns its slots in each part's table, read from the
        attached block tables as the worker's forward would (read first: copying them to the
        host waits for the device, which must not also wait for the slow forward)."""
        slots = [part.slot_mapping(reply).cpu().numpy() for part in parts]
        if slow_forward is not None:
            slow_forward()
        for part in parts:
            stage_pattern(part.staging, reply.scheduled.total_tokens, tag)
        return slots

    first = client.step(new=(["a", "b", "c", "d"], [6, 3, 9, 4], [0, 0, 5, 0]))
    a, b, c, d = first.admitted.tolist()
    first_slots = forward(first, 1)
    second = client.step(grants=([a, b, d], [3, 2, 1]), prefill=([c], [4]))
    second_slots = forward(second, 2)
    accepted = {a: 1, b: 2}
    third = client.step(results=(list(accepted), list(accepted.values())), reverts=[d],
                        finished=[c])
    label = "shard" if pool.shards else "group"
    mismatches = [f"{label} {r}: {m}" if len(parts) > 1 else m
                  for r, part in enumerate(parts)
                  for m in pool_mismatches(part.kv, committed_slots(first, first_slots[r], 1, {})
                                           | committed_slots(second, second_slots[r], 2,
                                                             accepted, {c, d}), poison)]
    return NworOutcome(mismatches, third.committed)
