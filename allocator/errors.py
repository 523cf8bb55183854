"""The allocator's one error tree: every error it raises on bad input or exhausted resources is
a `KVAllocError`, raised before any state changes, naming what was wrong.

``field`` says which input was at fault so a transport can map it to a 4xx naming the field.
The capacity errors come first; `NworError` roots those of acceptance, deferred writes and the
commit kernel. Accepted counts larger than the drafts are `AcceptedExceedsDrafts` in both (NWOR
sets ``field="accepted_counts"``), so a transport maps both versions of that mistake to one 4xx.
`InvariantViolation` stands apart: it is a bug, never a caller's mistake.
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


class OnboardingPending(KVAllocError):
    """The request's cached prefix is coming back from the host tier over more than this step's
    share (`capacity.onboard`): what came back stays cached in the pool; asked again, the
    request finds it there and the rest follows."""

    field = "req_id"


class BatchFull(KVAllocError):
    """Every block-table row (max_batch_size) is in use."""

    field = "req_id"


class InvariantViolation(AssertionError):
    """check_invariants() found the allocator in a state that must never exist."""


class PrefillIncomplete(KVAllocError):
    """A generation grant for a request whose prompt is not fully scheduled yet."""

    field = "req_id"


# NWOR (deferred KV writes) and SCV (acceptance).
class NworError(KVAllocError):
    """Base of the errors raised by acceptance, deferred writes and the commit kernel."""


class InvalidScvMode(NworError, ValueError):
    """``KVALLOC_SCV_MODE`` holds something other than off | graph | adaptive."""

    field = "KVALLOC_SCV_MODE"


class WindowStateError(NworError, RuntimeError):
    """A window call out of order: staging or committing with no open window, opening a second
    window, or capturing a graph while a window is open."""

    field = "window"


class NworInputError(NworError, ValueError):
    """A tensor or count whose shape, length, dtype, device or value the call cannot take."""


class SlotDtypeError(NworInputError):
    """Slots must be int64: an int32 slot mapping silently broke the write path once."""

    field = "slot_mapping"


class StagingOverflow(NworInputError):
    """A layer staged more tokens than the window schedules (the window must count every
    scheduled token: prefill chunks, last verified tokens and drafts)."""

    field = "slot_mapping"
