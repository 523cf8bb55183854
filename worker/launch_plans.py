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
    behind = int64s(r.unread for r in scheduled)
    num_drafts = int64s(r.num_drafts for r in scheduled)
    decode = num_drafts >= 0
    _check(scheduled, starts, num_tokens)
    ids = np.zeros(int(num_tokens.sum()), dtype=np.int64)
    drafted = [e for e, r in enumerate(scheduled) if r.drafts is not None]
    if drafted:  # a host drafter's: a device drafter writes its drafts on the device
        _place(ids, offsets[drafted] + 1, [scheduled[e].drafts for e in drafted])
    chunks = np.flatnonzero(~decode).tolist()
    prompts = [scheduled[e].admitted[scheduled[e].scheduled:][:num_tokens[e]] for e in chunks]
    if chunks:
        _place(ids, offsets[chunks], prompts)
    ends = decode.copy()  # emitting: the decodes, and the chunks that end their prompt
    for e, chunk in zip(chunks, prompts, strict=True):
        r = scheduled[e]
        r.scheduled += chunk.size
        ends[e] = r.decoding
    emitting = np.flatnonzero(ends)
    plan = LaunchPlan(np.asarray(sched.rows, dtype=np.int64), offsets, num_tokens, starts,
                      behind, ids, emitting, decode[emitting],
                      np.maximum(num_drafts[emitting], 0))
    if emitting.size == len(scheduled):  # a step of decodes and last chunks only
        return plan, list(scheduled)
    return plan, [scheduled[e] for e in emitting.tolist()]


def _check(scheduled: list[Request], starts: np.ndarray, num_tokens: np.ndarray) -> None:
    """Each entry must start where its request stands and run what it was granted: a decode its
    pending token and drafts, padded ones included, at its pending token's position (behind an
    unread step the reply's start counts only settled tokens); a prefill chunk the next tokens
    of its prompt, from where its scheduled tokens end."""
    for r, start, n in zip(scheduled, starts.tolist(), num_tokens.tolist(), strict=True):
        if r.num_drafts >= 0:
            expected, tokens = r.prompt.size + len(r.output) - 1 + r.unread, 1 + r.padded_drafts
        else:
            expected, tokens = r.scheduled, min(n, r.admitted.size - r.scheduled)
        if start != expected or tokens != n:
            raise EngineError(f"scheduled: request {r.req_id!r} got {n} tokens at position "
                              f"{start}; the worker expected {tokens} at {expected}")


def _place(ids: np.ndarray, at: np.ndarray, parts: list[np.ndarray]) -> None:
    """Write ``parts[i]`` into ``ids`` from ``at[i]`` on, every part in one scatter."""
    sizes = int64s(p.size for p in parts)
    # Each token's index: its part's start, plus its place among the concatenated parts less
    # the tokens of the parts before it.
    before = np.cumsum(sizes) - sizes
    ids[np.repeat(at - before, sizes) + np.arange(int(sizes.sum()))] = np.concatenate(parts)
