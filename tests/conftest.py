"""Shared fixtures.

- ``make_config(**overrides)``: a small CPU `PoolConfig` (tiny KV shape, small pool) so tests run
  in milliseconds; overrides win.
- ``make_manager(**overrides)``: a `KVCacheManager` over ``make_config(**overrides)``.
- ``make_each_manager(**overrides)``: the same, once with the numpy step and once with the
  compiled one (the test runs twice).
- ``cuda_device``: ``"cuda"``, or skip.
- ``zmq_context``: a ZeroMQ context of the test's own, destroyed after it. Peers of the service
  never share ``zmq.Context.instance()`` across tests: once one test leaves that process-wide
  context unusable, every later peer on it waits for handshakes and replies that never come.
- ``needs_triton_interpreter`` (in ``support/triton_interpreter.py``): the mark of the tests that
  run a Triton kernel in Triton's interpreter on CPU.

GPU variants: parametrise ``device`` over "cpu" and a "cuda" param carrying the ``gpu`` marker
plus a skip-without-CUDA, in the test module itself (see
tests/allocator/capacity/test_block_table.py): benchmarks/gpu_check.sh picks the modules to run on
the GPU by grepping their text for the marker. That run has only the runtime dependencies, so keep
dev-only imports (hypothesis, httpx, ...) out of this file and of modules with GPU tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq
from kvalloc.allocator import KVCacheManager, PoolConfig

# Helpers every folder of tests shares (harnesses, fixtures' building blocks) live in support/.
sys.path.insert(0, str(Path(__file__).parent / "support"))

CUDA_AVAILABLE = torch.cuda.is_available()

# Small enough to exhaust in a few calls, big enough for a handful of requests.
SMALL_POOL: dict[str, object] = {
    "num_blocks": 64,
    "tokens_per_block": 4,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 8,
    "device": "cpu",
    "max_batch_size": 8,
    "max_seq_len": 64,
    "max_draft_len": 3,
    "overlap_scheduler": True,
}


@pytest.fixture
def make_config() -> Callable[..., PoolConfig]:
    def factory(**overrides: object) -> PoolConfig:
        return PoolConfig(**{**SMALL_POOL, **overrides})

    return factory


@pytest.fixture
def make_manager(make_config: Callable[..., PoolConfig]) -> Callable[..., KVCacheManager]:
    def factory(**overrides: object) -> KVCacheManager:
        return KVCacheManager(make_config(**overrides))

    return factory


@pytest.fixture(params=[False, True], ids=["numpy_step", "compiled_step"])
def make_each_manager(make_config: Callable[..., PoolConfig],
                      request: pytest.FixtureRequest) -> Callable[..., KVCacheManager]:
    def factory(**overrides: object) -> KVCacheManager:
        return KVCacheManager(make_config(**overrides), compiled=request.param)

    return factory


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def cuda_device() -> str:
    if not CUDA_AVAILABLE:
        pytest.skip("needs CUDA")
    return "cuda"
