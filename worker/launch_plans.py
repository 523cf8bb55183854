"""`launch_plan`: a reply's schedule turned into the `LaunchPlan` the device step runs, checked
against what the worker planned: each entry must start where its request stands and run the
tokens it was granted (a decode: its pending token and drafts, padded ones included; a prefill
chunk: the next tokens of its prompt, which the host fills in). Behind an unread step (an
overlap worker's) a decode's start counts only the tokens the service has settled."""

from __future__ import annotations

import numpy as np
from kvalloc.server.contract.columns import StepResult
from kvalloc.worker.errors import EngineError
from kvalloc.worker.requests import Request, int64s
from kvalloc.worker.step.device_step import LaunchPlan


def launch_plan(reply: StepResult, scheduled: list[Request]) -> tuple[LaunchPlan, list[Request]]:
    """The step's `LaunchPlan` for ``scheduled`` (the request of each of the reply's entries, in
    its order) and the requests of its emitting entries; advances each prefill chunk's request
    past the chunk."""
    sched = reply.scheduled
    offsets = np.asarray(sched.token_offsets, dtype=np.int64)
    num_tokens = np.asarray(sched.num_tokens, dtype=np.int64)
    starts = np.asarray(sched.start_positions, dtype=np.int64)
    ids = np.zeros(int(num_tokens.sum()), dtype=np.int64)
    behind = int64s(r.unread for r in scheduled)
    emitting, decode, drafts = [], [], []
    for e, (r, off, n, start) in enumerate(zip(scheduled, offsets.tolist(),
                                               num_tokens.tolist(), starts.tolist(),
                                               strict=True)):
        if r.num_drafts >= 0:
            # Behind an unread step the reply's start counts only settled tokens.
            expected = r.prompt.size + len(r.output) - 1 + r.unread
            tokens = 1 + r.padded_drafts
            if r.drafts is not None:
                ids[off + 1:off + 1 + r.drafts.size] = r.drafts
        else:
            chunk = r.admitted[r.scheduled:r.scheduled + n]
            expected, tokens = r.scheduled, chunk.size
            ids[off:off + chunk.size] = chunk
            r.scheduled += chunk.size
        if start != expected or tokens != n:
            raise EngineError(f"scheduled: request {r.req_id!r} got {n} tokens at position "
                              f"{start}; the worker expected {tokens} at {expected}")
        if r.num_drafts >= 0 or r.decoding:
            emitting.append(e)
            decode.append(r.num_drafts >= 0)
            drafts.append(max(r.num_drafts, 0))
    plan = LaunchPlan(np.asarray(sched.rows, dtype=np.int64), offsets, num_tokens, starts,
                      behind, ids, int64s(emitting), np.array(decode, dtype=bool),
                      int64s(drafts))
    return plan, [scheduled[e] for e in emitting]
