"""Typed errors of NWOR (deferred KV writes) and SCV (acceptance).

Like every `KVAllocError`, each one is raised before any state changes and names the input at
fault in ``field``. Accepted counts larger than the drafts reuse `errors.AcceptedExceedsDrafts`
(with ``field="accepted_counts"``) so a transport maps both the allocator's and NWOR's version of
that mistake to the same 4xx.
"""

from __future__ import annotations

from .errors import KVAllocError


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
