"""The small loops every phase of the compiled step uses: report an error, find the first
marked row, copy arrays.

Invariants: `fail` writes the whole ``[kind, subject, index, detail]`` error (`codes`); the
phase that calls it returns at once.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.tuples import Rows, Settled


@inlined
def fail(error: np.ndarray, kind: int, subject: int, index: int, detail: int) -> None:
    """Report ``[kind, subject, index, detail]`` (`codes`) in ``error``."""
    error[0] = kind
    error[1] = subject
    error[2] = index
    error[3] = detail


@inlined
def first_marked(rows: np.ndarray, marks: np.ndarray, value: bool) -> int:
    """Index of the first of ``rows`` whose mark is ``value``, or -1."""
    for i in range(rows.size):
        if marks[rows[i]] == value:
            return i
    return -1


@inlined
def copy_settled(destination: Settled | Rows, source: Settled | Rows) -> None:
    """`Settled`'s fields from ``source`` to ``destination``."""
    copy_into(destination.capacity, source.capacity)
    copy_into(destination.history, source.history)
    copy_into(destination.slack, source.slack)
    copy_into(destination.draft_len, source.draft_len)
    copy_into(destination.pending, source.pending)
    copy_into(destination.lead, source.lead)
    copy_into(destination.ahead, source.ahead)
    copy_into(destination.behind, source.behind)
    copy_into(destination.behind_draft, source.behind_draft)
    copy_into(destination.behind_slack, source.behind_slack)


@inlined
def copy_into(destination: np.ndarray, source: np.ndarray) -> None:
    """``destination[:] = source`` for arrays of one length (as a loop: numba's slice assignment
    brings a shape check whose error message alone takes seconds to compile)."""
    for i in range(source.size):
        destination[i] = source[i]
