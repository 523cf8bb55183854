"""The state the batched step reads and writes, with whole-word names.

`RowState` holds one entry per block-table row (index = row); `CapacityState` bundles it with the
block pool (free stack, reference counts, the LRU list of parked cached blocks), the block table
(host cells, free-row stack) and the limits of the pool. Both step implementations
(`step.reference`, `step.compiled`) change exactly this state and nothing else (the counters
move by the deltas a step returns), so comparing two copies of it compares everything a step
can do.

A row is ``live`` while a request holds it. For a row that is not live every entry is 0/False.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import compress

import numpy as np
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.block_table import BlockTable
from kvalloc.allocator.config import PoolConfig, SlackPolicy

# SlackPolicy as the integer the compiled step takes.
POLICY_CODES: dict[SlackPolicy, int] = {
    SlackPolicy.RECLAIM: 0, SlackPolicy.NONE: 1, SlackPolicy.UNRECLAIMED: 2,
}


@dataclass
class ManagerCounters:
    """Cumulative event counts; the metrics layer exports them."""

    grants: int = 0
    draft_grants: int = 0
    grants_refused: int = 0
    reverts: int = 0
    updates: int = 0
    rewound_tokens: int = 0
    reclaimed_slack_tokens: int = 0
    padding_topups: int = 0
    requests_added: int = 0
    requests_refused: int = 0
    requests_freed: int = 0
    row_overflows: int = 0
    evicted_blocks: int = 0  # parked (cached, unowned) blocks evicted for new content
    prefix_queried_tokens: int = 0  # prompt tokens of new requests that came with token ids
    prefix_hit_tokens: int = 0  # of those, tokens found in cached blocks

    def add(self, deltas: np.ndarray) -> None:
        """Add a step's ``deltas`` (one per field, in field order)."""
        values = deltas.tolist()
        # The moved ones only, picked in C: most counters stay still in a step.
        for name, delta in compress(zip(COUNTER_NAMES, values, strict=True), values):
            setattr(self, name, getattr(self, name) + delta)


COUNTER_NAMES = tuple(f.name for f in fields(ManagerCounters))
COUNTER_INDEX = {name: i for i, name in enumerate(COUNTER_NAMES)}


@dataclass
class RowState:
    live: np.ndarray  # bool
    capacity: np.ndarray  # tokens reserved
    history: np.ndarray  # tokens committed (history <= capacity)
    prompt_len: np.ndarray
    slack: np.ndarray  # overlap slack the pending grant recorded
    draft_len: np.ndarray  # D of the pending grant
    pending: np.ndarray  # bool: holds a generation grant not yet settled or reverted
    # Accepted drafts of the last settled step: the device's lead over history under overlap.
    lead: np.ndarray
    num_blocks: np.ndarray  # == ceil(capacity / tokens_per_block)
    # Leading columns holding cached prefix blocks (shared, never written, never shrunk).
    cached: np.ndarray
    # Lag 2: the pending grant was made under lag 2 (its slack follows `lag2_slack`), and the
    # step granted before it is still unsettled (``behind``: its D and the slack it recorded).
    # Results settle the behind step first; a request has at most one.
    ahead: np.ndarray  # bool
    behind: np.ndarray  # bool; implies pending
    behind_draft: np.ndarray
    behind_slack: np.ndarray
    # A windowed group (`capacity.windows`): leading columns whose blocks went back to the pool
    # because no unsettled or future step reads them (the table holds `RELEASED` there). Always
    # 0 under full attention. A finished row frees only the blocks after them.
    released: np.ndarray

    @classmethod
    def empty(cls, num_rows: int) -> RowState:
        def counts() -> np.ndarray:
            return np.zeros(num_rows, dtype=np.int64)

        flags = np.zeros(num_rows, dtype=bool)
        return cls(live=flags, capacity=counts(), history=counts(), prompt_len=counts(),
                   slack=counts(), draft_len=counts(), pending=flags.copy(), lead=counts(),
                   num_blocks=counts(), cached=counts(), ahead=flags.copy(),
                   behind=flags.copy(), behind_draft=counts(), behind_slack=counts(),
                   released=counts())

    def reset(self, row: int) -> None:
        for arr in vars(self).values():
            arr[row] = 0


@dataclass(frozen=True)
class StepLimits:
    max_batch_size: int
    tokens_per_block: int
    max_blocks_per_seq: int
    max_draft_len: int
    max_seq_len: int
    overlap: bool
    policy: SlackPolicy

    @classmethod
    def of(cls, config: PoolConfig) -> StepLimits:
        return cls(config.max_batch_size, config.tokens_per_block, config.max_blocks_per_seq,
                   config.max_draft_len, config.max_seq_len, config.overlap_scheduler,
                   SlackPolicy(config.slack_policy))


@dataclass
class CapacityState:
    limits: StepLimits
    rows: RowState
    pool: BlockPool
    table: BlockTable
