"""The compile at start: a throwaway core runs through every kind of step for any pool shape
and feature set, leaves no shared memory behind, and leaves nothing for a real core's first
calls to compile."""

from __future__ import annotations

import sys

import pytest
from kvalloc.allocator.common.jit import numba
from kvalloc.server.client import Client
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.warmup import warm_up

SHAPES = [{}, {"tokens_per_block": 4, "max_seq_len": 16}, {"tokens_per_block": 1},
          {"max_draft_len": 0}, {"max_draft_len": 7, "tokens_per_block": 64},
          {"overlap_scheduler": False}, {"dtype": "fp8_e4m3"}]


def compiled_signatures() -> dict[str, int]:
    """How many type signatures each of the project's compiled loops has been compiled for."""
    from numba.core.registry import CPUDispatcher

    return {f"{name}.{attr}": len(value.signatures)
            for name, module in list(sys.modules.items())
            if name.split(".")[0] in ("allocator", "server")
            for attr, value in list(vars(module).items()) if isinstance(value, CPUDispatcher)}


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_warm_up_runs_for_every_shape_and_leaves_no_segment(
        make_config, shape: dict[str, object], prefix_caching: bool) -> None:
    pool = make_config(**{"num_blocks": 256, "max_seq_len": 64, **shape})
    before = set(SHM_DIR.glob("kvalloc-*"))
    assert warm_up(ServiceConfig(pool=pool, prefix_caching=prefix_caching,
                                 max_step_tokens=512)) > 0
    assert set(SHM_DIR.glob("kvalloc-*")) <= before


@pytest.mark.skipif(numba is None, reason="nothing is compiled without numba")
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_after_a_warm_up_a_real_cores_first_calls_compile_nothing(
        make_config, prefix_caching: bool) -> None:
    config = ServiceConfig(pool=make_config(num_blocks=256, max_seq_len=64),
                           prefix_caching=prefix_caching, max_step_tokens=512)
    warm_up(config)
    built = compiled_signatures()
    core = ServiceCore(config)
    try:
        for attach in (True, False):
            client = Client.in_process(core, worker_id=f"first-{attach}")
            client.register(attach=attach)
            ids = list(range(6)) if prefix_caching else ()
            (a,) = client.step(new=(["a"], [6]), prompt_token_ids=ids).admitted
            client.step(grants=([a], [3]))
            client.step(results=([a], [2]), grants=([a], [3]))
            client.step(results=([a], [0]), finished=[a])
            client.deregister()
    finally:
        core.close()
    assert compiled_signatures() == built


def test_a_warm_up_outlasting_the_lease_still_runs_to_its_end(make_config) -> None:
    """A lease shorter than any call of the warm-up (as a compile between two calls outlasts
    the real one on a fresh install): its throwaway workers keep theirs and it completes."""
    config = ServiceConfig(pool=make_config(num_blocks=256, max_seq_len=64), lease_ttl_s=1e-9,
                           max_step_tokens=512)
    assert warm_up(config) > 0
