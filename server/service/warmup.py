"""Compiling everything a step runs before the service takes its first call.

The service's hot loops are compiled by numba on their first call (from its disk cache when a
process compiled them before: seconds; on a fresh install: 12-15 s on a small CPU machine), and
on a GPU the commit kernel compiles and its graphs are captured on a worker's first
registration. Done on the first real call, all of that runs under the core's lock: the first
worker's registration and step, and everyone else's calls behind them, wait past any reasonable
timeout. `warm_up` does it at start instead, before the service listens: it runs a throwaway
core of the same layer shape, device and features, and a small pool, through a short life of two
workers that covers every kind of step entry. The compiled code is per process, so the real
core's first calls find it built. The throwaway core's shared memory goes with it.

Its workers' leases never run out: a compile between two of their calls outlasts any lease
(28 s on a loaded machine against the default 30 s), and an expired lease would end the
warm-up half way, leaving the rest to the first real calls.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

WARM_UP_EVENTS = "inproc://kvalloc-warm-up"  # its KV events go nowhere
_ROWS = 4  # requests the throwaway pool holds
_PROMPTS = (6, 9, 5)  # the script's prompts: one whole, one chunked, one reverted
_ENDLESS_LEASE_S = float("inf")  # the throwaway workers' lease: see the module's docstring


def warm_up(config: ServiceConfig) -> float:
    """Run a throwaway core like ``config``'s through every kind of step once; the seconds it
    took."""
    began = time.perf_counter()
    core = ServiceCore(_small(config))
    try:
        # The second's replies carry tables; a grouped pool's workers all attach.
        for life, attached in enumerate((True,) if config.groups else (True, False)):
            _life(core, life, attached)
    finally:
        core.close()
    return time.perf_counter() - began


def _small(config: ServiceConfig) -> ServiceConfig:
    """``config`` with a pool of a few short rows (the same layer shape, dtype and device)."""
    pool = config.pool
    shape = pool.model_dump()
    shape.update(max_batch_size=_ROWS, max_seq_len=sum(_PROMPTS) + 2 * pool.max_draft_len + 1,
                 memory_budget_bytes=None, num_blocks=1)
    rows = type(pool).model_construct(**shape).max_blocks_per_seq  # (num_blocks not read)
    small = type(pool).model_validate({**shape, "num_blocks": _ROWS * rows})
    return config.model_copy(update={
        "pool": small, "groups": [g.model_copy(update={"num_blocks": small.num_blocks})
                                  for g in config.groups],
        "max_step_tokens": max(sum(_PROMPTS), _ROWS * (1 + small.max_draft_len)),
        "max_workers": 2, "token": None, "lease_ttl_s": _ENDLESS_LEASE_S,
        "kv_events": WARM_UP_EVENTS if config.kv_events is not None else None,
        "kv_events_replay": None})


def _life(core: ServiceCore, life: int, attached: bool) -> None:
    """Admit three prompts (one chunked, with token ids under prefix caching: each life's its
    own, so that no prompt finds another's blocks cached), decode with padded and plain grants,
    accept, revert, finish, and deregister."""
    worker_id = f"warm-up-{life}"
    reg = core.register(wire.RegisterRequest(worker_id=worker_id, attached=attached))
    d = core.config.pool.max_draft_len
    ids = ((np.arange(sum(_PROMPTS)) + life * sum(_PROMPTS)) if core.config.prefix_caching
           else ())
    steps = itertools.count()

    def step(**columns: object) -> np.ndarray:
        call = StepCall.build(worker_id, reg.session, reg.epoch, next(steps), **columns)
        return core.step(call).admitted

    a, b, c = step(new_req_ids=("a", "b", "c"), prompt_lens=_PROMPTS,
                   first_chunks=(0, 4, 0), prompt_token_ids=ids).tolist()
    padding = {"padding_handles": [a], "padded_draft_lens": [d]} if d else {}
    step(grant_handles=[a, c], draft_lens=[max(d - 1, 0), d], prefill_handles=[b],
         prefill_tokens=[_PROMPTS[1] - 4], **padding)
    step(result_handles=[a], num_accepted=[min(1, max(d - 1, 0))], revert_handles=[c],
         grant_handles=[a, b], draft_lens=[d, d])
    step(result_handles=[a, b], num_accepted=[d, 0], finished_handles=[a, b, c])
    core.deregister(wire.WorkerRef(worker_id=worker_id, session=reg.session))
