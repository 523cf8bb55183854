"""`InFlight`: an overlap worker's last two steps, whose results come one call late (lag 2).

An overlap worker's call for step k may grant a request whose step k-1 is still running on its
device; the call's results settle each request's oldest unsettled step, so step k-2's accepted
counts come with it, and a revert undoes the request's newest step (docs/design.md, "Lag"). The
service keeps the worker's last two batches:

- ``older`` (step k-2): every decode of it still waiting must be settled by this call: reported,
  finished, or reverted where nothing newer of its request waits (the revert then undoes it);
  `StepNotSettled` names the first that is not;
- ``newest`` (step k-1): the call may settle its decodes already (a result for a request with
  nothing older waiting, a revert, a finish); the rest wait for the next call.

After the call the older batch retires: each of its requests is settled, and its forward is known
to have run. Such a worker commits its own tokens, so a batch keeps only what settling needs: per
entry, whether its decode still waits and whether its request was dropped (reverted or finished).
Entries are matched by block-table row: a row goes to a new request only in a call that freed it,
and that call drops every entry of the request it held, so a dropped entry never waits.

`settle_reference` states the rule in numpy; `settle_compiled` is the same as one numba loop (a
call's settle was a few dozen tiny array operations, a fifth of the service's step for such a
worker). Tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from kvalloc.allocator.common.jit import jit, numba, views
from kvalloc.server.contract.columns import NO_VALUES, Scheduled
from kvalloc.server.contract.errors import StepNotSettled


@dataclass(eq=False)  # not frozen, as `columns`' records: built every step, never changed
class Flight:
    """One step's batch as settling sees it; arrays per entry of ``scheduled``."""

    scheduled: Scheduled
    step_id: int
    waiting: np.ndarray  # bool: a decode whose results have not come
    dropped: np.ndarray  # bool: its request was reverted or finished: nothing of it is kept

    @classmethod
    def of(cls, scheduled: Scheduled, num_decodes: int, step_id: int) -> Flight:
        """A batch just laid out: its first ``num_decodes`` entries wait for results."""
        waiting = np.zeros(len(scheduled), bool)
        waiting[:num_decodes] = True
        return cls(scheduled, step_id, waiting, np.zeros(waiting.size, bool))


class Settled(NamedTuple):
    """Both batches as a call leaves them (`InFlight.settle`), applied by `InFlight.advance`."""

    older: Flight | None  # every decode settled: it retires
    newest: Flight | None


@dataclass
class InFlight:
    older: Flight | None = None
    newest: Flight | None = None

    def settle(self, result_rows: np.ndarray, revert_rows: np.ndarray,
               finished_rows: np.ndarray, *, num_rows: int) -> Settled:
        """What the call settles of both batches, changing nothing here (the manager's step may
        still refuse the call); `StepNotSettled` naming the first decode of the older batch it
        leaves waiting. ``num_rows``: the block table's."""
        o, n = self.older, self.newest
        older_dropped, missing, newest_waiting, newest_dropped = settle_flags(
            result_rows, revert_rows, finished_rows, num_rows, *_columns(o), *_columns(n))
        if missing >= 0:
            assert o is not None
            count = int((o.waiting & ~_settled_by(o, older_dropped, result_rows, num_rows)).sum())
            raise StepNotSettled(
                f"results: the request of handle {int(o.scheduled.handles[missing])} ran "
                f"in step {o.step_id}, two calls ago: report its accepted count, finish it, "
                f"or revert it if that step is its newest ({count} unsettled)")
        # Built field by field: `dataclasses.replace` costs several constructors.
        older = None if o is None else Flight(o.scheduled, o.step_id,
                                              np.zeros(o.waiting.size, bool), older_dropped)
        newest = None if n is None else Flight(n.scheduled, n.step_id, newest_waiting,
                                               newest_dropped)
        return Settled(older, newest)

    def advance(self, settled: Settled, flight: Flight) -> Flight | None:
        """Apply ``settled`` (the call was applied) and take ``flight``, the batch the call laid
        out; returns the batch that retires (None while fewer than two steps ran)."""
        self.older, self.newest = settled.newest, flight
        return settled.older


_NONE = np.zeros(0, dtype=bool)


def _columns(flight: Flight | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if flight is None:
        return NO_VALUES, _NONE, _NONE
    return flight.scheduled.rows, flight.waiting, flight.dropped


def _settled_by(older: Flight, dropped: np.ndarray, result_rows: np.ndarray,
                num_rows: int) -> np.ndarray:
    """Per older entry: settled by a result or dropped (for the error's count only)."""
    return _flags(result_rows, num_rows)[older.scheduled.rows] | dropped


def settle_reference(result_rows: np.ndarray, revert_rows: np.ndarray,
                     finished_rows: np.ndarray, num_rows: int, older_rows: np.ndarray,
                     older_waiting: np.ndarray, older_dropped: np.ndarray,
                     newest_rows: np.ndarray, newest_waiting: np.ndarray,
                     newest_dropped: np.ndarray) -> tuple[np.ndarray, int, np.ndarray,
                                                          np.ndarray]:
    """The specification: ``(older dropped, first older entry left waiting or -1, newest
    waiting, newest dropped)`` after the call. An older decode is settled by a result, a
    finish, or a revert where nothing newer of its request waits (the revert undoes it); a
    newest entry goes with a finish or a revert, and a result settles it early where nothing
    older of its request waits."""
    reported, reverted, finished = (_flags(rows, num_rows)
                                    for rows in (result_rows, revert_rows, finished_rows))
    newer_waits = _flags(newest_rows[newest_waiting], num_rows)
    older_waits = _flags(older_rows[older_waiting], num_rows)
    undone = older_waiting & reverted[older_rows] & ~newer_waits[older_rows]
    left = np.flatnonzero(older_waiting & ~(reported[older_rows] | finished[older_rows] | undone))
    gone = finished[newest_rows] | (newest_waiting & reverted[newest_rows])
    early = reported[newest_rows] & ~older_waits[newest_rows]
    return (older_dropped | finished[older_rows] | undone, int(left[0]) if left.size else -1,
            newest_waiting & ~gone & ~early, newest_dropped | gone)


def _settle_loop(result_rows, revert_rows, finished_rows, num_rows, older_rows, older_waiting,
                 older_dropped, newest_rows, newest_waiting,
                 newest_dropped):  # pragma: no cover
    # Compiled by numba; `settle_reference` states what it computes.
    marks = np.zeros(num_rows, np.uint8)  # bits: 1 reported, 2 reverted, 4 finished, 8 newer
    for r in result_rows:
        marks[r] |= 1
    for r in revert_rows:
        marks[r] |= 2
    for r in finished_rows:
        marks[r] |= 4
    for i in range(newest_rows.size):
        if newest_waiting[i]:
            marks[newest_rows[i]] |= 8
    # The three flag columns as one array: each array returned costs a conversion.
    num_older, num_newest = older_rows.size, newest_rows.size
    flags = np.empty(num_older + 2 * num_newest, np.bool_)
    dropped = flags[:num_older]
    waiting = flags[num_older:num_older + num_newest]
    gone_flags = flags[num_older + num_newest:]
    dropped[:] = older_dropped
    gone_flags[:] = newest_dropped
    missing = -1
    older_waits = np.zeros(num_rows, np.bool_)
    for i in range(older_rows.size):
        m = marks[older_rows[i]]
        if (m & 4) != 0:
            dropped[i] = True
        if not older_waiting[i]:
            continue
        older_waits[older_rows[i]] = True
        if (m & 2) != 0 and (m & 8) == 0:  # a revert with nothing newer waiting undoes it
            dropped[i] = True
        elif (m & 5) == 0 and missing < 0:
            missing = i
    for i in range(newest_rows.size):
        m = marks[newest_rows[i]]
        gone = (m & 4) != 0 or (newest_waiting[i] and (m & 2) != 0)
        early = (m & 1) != 0 and not older_waits[newest_rows[i]]
        waiting[i] = newest_waiting[i] and not gone and not early
        gone_flags[i] = gone_flags[i] or gone
    return flags, missing


if numba is not None:
    _compiled_settle = jit(_settle_loop)


def settle_compiled(*args: Any) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """`settle_reference` as one compiled loop (same arguments, same result: the flags are
    views of the one array the loop returns)."""
    flags, missing = _compiled_settle(*args)
    dropped, waiting, gone = views(flags, (args[4].size, args[7].size))
    return dropped, int(missing), waiting, gone


settle_flags = settle_compiled if numba is not None else settle_reference


def _flags(rows: np.ndarray, num_rows: int) -> np.ndarray:
    flags = np.zeros(num_rows, dtype=bool)
    flags[rows] = True
    return flags
