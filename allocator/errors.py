"""Typed errors. Every one is raised before any state changes, and names what was wrong.

``field`` says which input was at fault so a transport can map it to a 4xx naming the field.
"""

from __future__ import annotations


class KVAllocError(Exception):
    """Base of every error the allocator raises on bad input or exhausted resources."""

    field: str = ""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field or self.field


class UnknownRequest(KVAllocError, KeyError):
    field = "req_id"

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateRequest(KVAllocError):
    field = "req_id"


class InvalidValue(KVAllocError, ValueError):
    """A count is negative, or otherwise outside what the field allows."""


class DraftLenExceeded(InvalidValue):
    field = "draft_len"


class AcceptedExceedsDrafts(InvalidValue):
    field = "num_accepted"


class GrantPending(KVAllocError):
    """A generation grant was asked for while the previous one is neither updated nor reverted."""

    field = "req_id"


class NoPendingGrant(KVAllocError):
    """update / revert / padding for a request that holds no generation grant."""

    field = "req_id"


class OutOfBlocks(KVAllocError):
    """The pool cannot supply the blocks asked for; nothing was allocated."""

    field = "num_blocks"


class BlockTableOverflow(KVAllocError):
    """The request would need more blocks than a block-table row has (max_blocks_per_seq)."""

    field = "capacity"

    def __init__(self, message: str, *, row: int = -1, req_id: object = None) -> None:
        super().__init__(message)
        # The overflowing request (its row, and its id if it has one), so a batch's caller need
        # not guess which one to finish or preempt.
        self.row = row
        self.req_id = req_id


class BatchFull(KVAllocError):
    """Every block-table row (max_batch_size) is in use."""

    field = "req_id"


class InvariantViolation(AssertionError):
    """check_invariants() found the allocator in a state that must never exist."""


class PrefillIncomplete(KVAllocError):
    """A generation grant for a request whose prompt is not fully scheduled yet."""

    field = "req_id"
