"""The worker on a grouped pool with prefix caching (float32): Qwen2 with layer 0 full and layer
1 sliding over 16 positions (``qwen2_mixed``) through a real grouped in-process service
(`ServiceConfig.groups`: ``full`` keeps every block, ``window16`` gives back the blocks behind
its window, each group its own pool, table, staging and write protection), with prompts that
share a prefix of 32 tokens, twice the window: later prompts are admitted with a hit in both
groups and their tokens are transformers' own, synchronously and one step ahead (the worker's
own commit into each group, refused in that group's cached blocks).

Both groups' pools and stagings start as NaN, and after every call every block of a group that
no row holds and its cache does not keep (its protection) is NaN again: a hit that read a block
its group did not keep, or a windowed hit that read behind its window, would change the tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from kvalloc.allocator import LayerGroup
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.requests import NamedPrompt
from test_worker_window import WINDOW, shared_prefixes
from worker_oracle import MAX_NEW_TOKENS, Oracle, make_oracle, pool_config

pytest_plugins = ["worker_fixtures"]

# Each group a pool of its own size: the windowed group needs a window's blocks a row.
GROUPS = [LayerGroup(name="full", layers=(0,), num_blocks=256),
          LayerGroup(name=f"window{WINDOW}", layers=(1,), window=WINDOW, num_blocks=96)]


@pytest.fixture(scope="module")
def mixed(one_thread: None) -> Oracle:
    return make_oracle("qwen2_mixed")


@pytest.fixture
def grouped_core() -> Iterator[Callable[..., ServiceCore]]:
    cores: list[ServiceCore] = []

    def make(oracle: Oracle, device: str = "cpu") -> ServiceCore:
        base = pool_config(oracle.model, device=device)
        # A lease past a cold CUDA run's first kernel compiles.
        cores.append(ServiceCore(ServiceConfig(pool=base.pool, max_step_tokens=base.max_step_tokens,
                                               groups=GROUPS, prefix_caching=True,
                                               lease_ttl_s=600.0)))
        return cores[-1]

    yield make
    for core in cores:
        core.close()


class GroupPoison:
    """Wraps ``client.step``: after each reply, in every group, the blocks no row holds and the
    group's cache does not keep are NaN; counts the blocks poisoned and the cached tokens of
    the replies."""

    def __init__(self, client: Client) -> None:
        self.groups = client.pool.groups
        for group in self.groups:
            group.kv.fill_(float("nan"))
            group.staging.fill_(float("nan"))
        self.poisoned = [0] * len(self.groups)
        self.cached = 0
        step = client.step

        def stepping(**call: object) -> StepResult:
            reply = step(**call)
            self.cached += int(reply.cached_tokens.sum())
            self.after()
            return reply

        client.step = stepping  # type: ignore[method-assign]

    def after(self) -> None:
        for index, group in enumerate(self.groups):
            held = torch.zeros(group.kv.shape[2], dtype=torch.bool, device=group.kv.device)
            table = group.block_table
            held[table[table >= 0].long()] = True
            assert group.protected is not None
            free = torch.nonzero(~(held | group.protected))[:, 0]
            group.kv[:, :, free] = float("nan")
            self.poisoned[index] += free.numel()


def run_shared_prefixes(core: ServiceCore, model: torch.nn.Module, prompts: list[NamedPrompt],
                        expected: dict[str, list[int]], *, overlap: bool, draft_len: int,
                        rate: float | None, vocab_size: int, stop_token_ids: list[int]
                        ) -> tuple[dict[str, list[int]], Engine, GroupPoison]:
    client = Client.in_process(core, worker_id="worker")
    client.register(overlap=overlap)
    poison = GroupPoison(client)
    device = str(client.pool.kv.device)
    drafter = None if rate is None else DeviceOracleDrafter(
        expected, rate, vocab_size=vocab_size, device=device, seed=3)
    engine = Engine(model, client, drafter, draft_len=draft_len, stop_token_ids=stop_token_ids,
                    overlap=overlap, validate=True, share_prefixes=True)
    # The first prompt alone, then the rest: its blocks are hit once no row holds them, kept
    # (parked) by each group's cache alone.
    outputs = engine.run(prompts[:1], MAX_NEW_TOKENS)
    outputs.update(engine.run(prompts[1:], MAX_NEW_TOKENS))
    return outputs, engine, poison


def check_hits(core: ServiceCore, engine: Engine, poison: GroupPoison) -> None:
    """Later prompts hit the shared prefix in both groups, by whole blocks, and nothing the
    service or the worker committed was refused by a group's protection."""
    stats = engine.stats
    assert stats.table_violations == 0
    assert stats.cached_prompt_tokens > 0 and stats.cached_prompt_tokens % 4 == 0
    assert poison.cached == stats.cached_prompt_tokens
    hits = [m.counters.prefix_hit_tokens for m in core.groups.managers.values()]
    assert hits == [stats.cached_prompt_tokens] * 2
    assert all(n > 0 for n in poison.poisoned)
    assert all(c.writes.metrics().protected_refusals == 0 for c in core.pool.commits.shards)
    core.check_invariants()


@pytest.mark.parametrize(("overlap", "draft_len", "rate"), [
    (False, 0, None), (False, 3, 0.5), (True, 0, None), (True, 3, 0.5)])
def test_shared_prefixes_hit_both_groups_with_the_exact_tokens(
        mixed: Oracle, grouped_core: Callable, overlap: bool, draft_len: int,
        rate: float | None) -> None:
    prompts, expected = shared_prefixes("qwen2_mixed")
    core = grouped_core(mixed)
    outputs, engine, poison = run_shared_prefixes(
        core, mixed.model, prompts, expected, overlap=overlap, draft_len=draft_len, rate=rate,
        vocab_size=mixed.model.config.vocab_size, stop_token_ids=mixed.stop_tokens())
    assert outputs == expected
    check_hits(core, engine, poison)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_on_cuda_shared_prefixes_hit_both_groups_with_the_exact_tokens(
        mixed: Oracle, grouped_core: Callable, overlap: bool) -> None:
    """The same on a CUDA pool, against generate's tokens on CUDA."""
    model = copy.deepcopy(mixed.model).to("cuda")
    reference = copy.deepcopy(mixed.reference).to("cuda")
    prompts, _ = shared_prefixes("qwen2_mixed")
    expected = {}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.token_ids], device="cuda")
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS)
            expected[p.req_id] = out[0, ids.shape[1]:].tolist()
    core = grouped_core(mixed, device="cuda")
    outputs, engine, poison = run_shared_prefixes(
        core, model, prompts, expected, overlap=overlap, draft_len=3, rate=0.5,
        vocab_size=mixed.model.config.vocab_size, stop_token_ids=mixed.stop_tokens())
    assert outputs == expected
    check_hits(core, engine, poison)
