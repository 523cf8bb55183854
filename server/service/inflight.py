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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from server.contract.columns import NO_VALUES, Scheduled
from server.contract.errors import StepNotSettled


@dataclass(frozen=True)
class Flight:
    """One step's batch as settling sees it; arrays per entry of ``scheduled``."""

    scheduled: Scheduled
    step_id: int
    waiting: np.ndarray  # bool: a decode whose results have not come
    dropped: np.ndarray  # bool: its request was reverted or finished: nothing of it is kept

    @classmethod
    def of(cls, scheduled: Scheduled, num_decodes: int, step_id: int) -> Flight:
        """A batch just laid out: its first ``num_decodes`` entries wait for results."""
        entries = np.arange(len(scheduled))
        return cls(scheduled, step_id, entries < num_decodes, np.zeros(entries.size, bool))


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
        reported, reverted, finished = (_flags(rows, num_rows)
                                        for rows in (result_rows, revert_rows, finished_rows))
        newer_waits = _flags(_waiting_rows(self.newest), num_rows)
        older_waits = _flags(_waiting_rows(self.older), num_rows)
        older = newest = None
        if self.older is not None:
            o = self.older
            rows = o.scheduled.rows
            undone = o.waiting & reverted[rows] & ~newer_waits[rows]
            missing = np.flatnonzero(o.waiting & ~(reported[rows] | finished[rows] | undone))
            if missing.size:
                raise StepNotSettled(
                    f"results: the request of handle {int(o.scheduled.handles[missing[0]])} ran "
                    f"in step {o.step_id}, two calls ago: report its accepted count, finish it, "
                    f"or revert it if that step is its newest ({missing.size} unsettled)")
            older = replace(o, waiting=np.zeros_like(o.waiting),
                            dropped=o.dropped | finished[rows] | undone)
        if self.newest is not None:
            n = self.newest
            rows = n.scheduled.rows
            gone = finished[rows] | (n.waiting & reverted[rows])
            early = reported[rows] & ~older_waits[rows]
            newest = replace(n, waiting=n.waiting & ~gone & ~early, dropped=n.dropped | gone)
        return Settled(older, newest)

    def advance(self, settled: Settled, flight: Flight) -> Flight | None:
        """Apply ``settled`` (the call was applied) and take ``flight``, the batch the call laid
        out; returns the batch that retires (None while fewer than two steps ran)."""
        self.older, self.newest = settled.newest, flight
        return settled.older


def _waiting_rows(flight: Flight | None) -> np.ndarray:
    return NO_VALUES if flight is None else flight.scheduled.rows[flight.waiting]


def _flags(rows: np.ndarray, num_rows: int) -> np.ndarray:
    flags = np.zeros(num_rows, dtype=bool)
    flags[rows] = True
    return flags
