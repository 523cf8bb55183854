"""The worker on a windowed pool (float32, CPU): a pool whose rows give back the blocks behind
every window (`PoolConfig.window`) serves a model whose every layer slides no further, with
exactly transformers' tokens, synchronously and one step ahead.

Every run poisons the pool with NaN, and after every call poisons again every block no row
holds: the blocks released behind a window, freed and maybe granted to another request since,
hold NaN (or that request's K/V) from then on, so a read of one would change the tokens. The
pool watches of the exact and overlap tests check every slot besides. The rows hold no more
blocks than a window needs (`PoolConfig.max_live_blocks_per_seq`) once they decode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

import pytest
import torch
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.service.core import ServiceCore
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.errors import LayoutMismatch
from kvalloc.worker.requests import NamedPrompt
from test_worker_exact import PoolWatch, make_drafter, run_worker
from test_worker_overlap import CommitReplay
from worker_oracle import MAX_NEW_TOKENS, Oracle, make_oracle, pool_config

pytest_plugins = ["worker_fixtures"]

WINDOW = 16  # the windowed families' sliding_window (worker_oracle)
FAMILIES = ["mistral", "deepseek_v3_window"]


class GiveBacks:
    """Wraps ``client.step``: after each reply every block no row holds is NaN in the pool and
    in ``shadow`` (the test's copy of what the pool must hold), and the most blocks a decoding
    row holds is recorded (rows decode once two calls in a row schedule no prefill). With a
    prefix cache, the blocks it keeps (parked or not) are spared.
    ``committed(call)``, when given, puts what the call committed into the shadow first: a
    call may commit a prefill chunk and give back its first blocks at once. ``group``: the
    group of a grouped pool whose blocks these are (its KV, table and cached blocks)."""

    def __init__(self, client: Client, shadow: torch.Tensor,
                 committed: Callable[[dict], None] | None = None,
                 group: int | None = None) -> None:
        pool = client.pool if group is None else client.pool.groups[group]
        self.pool, self.table = pool.kv, pool.block_table
        self.cached = pool.protected  # the blocks a prefix cache keeps
        layers, planes, blocks, per_block, heads, dim = self.pool.shape
        self.shadow = shadow.view(layers, planes, blocks, per_block, heads, dim)
        self.most_decoding, self.released, self.poisoned = 0, 0, 0
        self._decode_calls = 0
        step = client.step

        def stepping(**call: object) -> StepResult:
            reply = step(**call)
            if committed is not None:
                committed(call)
            self.after(prefilling="prefill" in call or "new" in call)
            return reply

        client.step = stepping  # type: ignore[method-assign]

    def after(self, prefilling: bool) -> None:
        held = torch.zeros(self.pool.shape[2], dtype=torch.bool)
        held[self.table[self.table >= 0].long()] = True
        if self.cached is not None:  # a parked cached block may be hit again
            held |= self.cached
        free = torch.nonzero(~held)[:, 0]
        self.pool[:, :, free] = float("nan")
        self.shadow[:, :, free] = float("nan")
        self.poisoned += free.numel()
        self.released += int((self.table == RELEASED).sum())
        self._decode_calls = 0 if prefilling else self._decode_calls + 1
        if self._decode_calls >= 2:
            self.most_decoding = max(self.most_decoding, int((self.table >= 0).sum(1).max()))


def run_sync(oracle: Oracle, connect: Callable, kind: object, draft_len: int,
             prompts: list[NamedPrompt] | None = None, expected: dict | None = None,
             max_new_tokens: int = MAX_NEW_TOKENS, **pool: object
             ) -> tuple[Engine, dict[str, list[int]], GiveBacks, int]:
    config = pool_config(oracle.model, window=WINDOW, **pool)
    client = connect(config)
    client.pool.kv.fill_(float("nan"))
    watch = PoolWatch(oracle, client.pool.kv, client.pool.block_table)
    gives = GiveBacks(client, watch.shadow, watch.apply_commit if prompts is None else None)
    engine = Engine(oracle.model, client, make_drafter(oracle, kind), draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), validate=True)
    outputs = engine.run(prompts or oracle.prompts, max_new_tokens,
                         on_step=watch.check if prompts is None else None)
    assert engine.stats.table_violations == 0
    return engine, outputs, gives, config.pool.max_live_blocks_per_seq


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("draft_len", "kind"), [(0, None), (3, 0.5), (3, "ngram")])
def test_a_windowed_pool_gives_the_exact_tokens_and_blocks_back(
        connect: Callable, one_thread: None, family: str, draft_len: int, kind: object) -> None:
    oracle = make_oracle(family)
    _, outputs, gives, bound = run_sync(oracle, connect, kind, draft_len)
    assert outputs == oracle.expected
    assert gives.released > 0 and gives.poisoned > 0
    assert 0 < gives.most_decoding <= bound


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("draft_len", "rate"), [(0, None), (3, 0.5), (3, 1.0)])
def test_one_step_ahead_on_a_windowed_pool(connect: Callable, one_thread: None, family: str,
                                           draft_len: int, rate: float | None) -> None:
    oracle = make_oracle(family)
    config = pool_config(oracle.model, window=WINDOW)
    client = connect(config, overlap=True)
    client.pool.kv.fill_(float("nan"))
    replay = CommitReplay(oracle, client.pool.kv)
    gives = GiveBacks(client, replay.shadow)
    drafter = None if rate is None else DeviceOracleDrafter(
        oracle.expected, rate, vocab_size=oracle.model.config.vocab_size, device="cpu", seed=3)
    engine = Engine(oracle.model, client, drafter, draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), overlap=True, validate=True)
    assert engine.run(oracle.prompts, MAX_NEW_TOKENS, on_step=replay) == oracle.expected
    replay.check()
    stats = engine.stats
    assert stats.forwards_ahead > stats.steps // 2 and stats.table_violations == 0
    assert replay.kept > 0 and stats.committed_tokens == replay.kept
    assert gives.released > 0 and 0 < gives.most_decoding <= config.pool.max_live_blocks_per_seq


def test_a_long_request_holds_a_windows_blocks_however_long_it_grows(
        connect: Callable, one_thread: None) -> None:
    """One prompt of 41 tokens and 100 new ones (141 tokens: 36 blocks of 4): once it
    decodes it never holds more than `max_live_blocks_per_seq` (8), and its tokens are
    generate's."""
    oracle = make_oracle("mistral")
    prompt = oracle.prompts[6]
    ids = torch.tensor([prompt.token_ids])
    with torch.inference_mode():
        out = oracle.reference.generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=100)
    expected = {prompt.req_id: out[0, ids.shape[1]:].tolist()}
    _, outputs, gives, bound = run_sync(oracle, connect, "ngram", 3, prompts=[prompt],
                                        max_new_tokens=100, max_seq_len=160)
    assert outputs == expected
    assert bound == 8 and 0 < gives.most_decoding <= bound < -(-141 // 4)


@pytest.mark.parametrize(("family", "window", "reads"), [
    ("llama", 16, "layer 0 of the model reads its whole history (2 layers read further)"),
    ("qwen2", 16, "layer 0 of the model reads its whole history (2 layers read further)"),
    ("mistral", 8, "layer 0 of the model reads a window of 16 (2 layers read further)"),
    ("deepseek_v3", 16, "layer 0 of the model reads its whole history (3 layers read "
                        "further)"),
    ("qwen2_mixed", 16, "layer 0 of the model reads its whole history")])
def test_a_layer_reading_past_the_pools_window_is_refused(
        one_thread: None, family: str, window: int, reads: str) -> None:
    """The pool would give back blocks such a layer still reads: the worker refuses it at
    once, naming window and the pool that would serve the model; a wider pool serves it."""
    oracle = make_oracle(family)
    core = ServiceCore(pool_config(oracle.model, window=window))
    try:
        client = Client.in_process(core, worker_id="w")
        client.register()
        with pytest.raises(LayoutMismatch, match=rf"^window: .* of {window}, but "
                                                 rf"{re.escape(reads)}\. A pool for this "
                                                 rf"model: kvalloc serve"):
            Engine(oracle.model, client, None, draft_len=0)
    finally:
        core.close()
    if family == "mistral":
        wider = ServiceCore(pool_config(oracle.model, window=32))
        try:
            client = Client.in_process(wider, worker_id="w")
            client.register()
            engine = Engine(oracle.model, client, None, draft_len=0,
                            stop_token_ids=oracle.stop_tokens())
            assert engine.run(oracle.prompts, MAX_NEW_TOKENS) == oracle.expected
        finally:
            wider.close()


def test_a_model_of_full_and_sliding_layers_is_exact_on_a_full_pool(
        connect: Callable, one_thread: None) -> None:
    """Qwen2 with layer 0 full and layer 1 sliding over 16 (transformers' ``layer_types``):
    each layer attends with its own window over a pool that keeps every block; a windowed
    pool is refused it (above)."""
    oracle = make_oracle("qwen2_mixed")
    full = make_oracle("qwen2")  # the same weights and prompts, every layer full
    assert [p.token_ids for p in oracle.prompts] == [p.token_ids for p in full.prompts]
    assert list(oracle.expected.values()) != list(full.expected.values())
    _, outputs, _ = run_worker(oracle, connect, make_drafter(oracle, 0.5), 3)
    assert outputs == oracle.expected


@cache
def shared_prefixes(family: str) -> tuple[list[NamedPrompt], dict[str, list[int]]]:
    """Five prompts of 40 tokens sharing their first 32 (past the window of 16, so a hit's
    first four columns start released), and generate's tokens for them."""
    oracle = make_oracle(family)
    base = oracle.prompts[-1].token_ids
    prompts = [NamedPrompt(f"p{i}", base[:32] + base[40 + 2 * i : 48 + 2 * i])
               for i in range(5)]
    expected = {}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.token_ids])
            out = oracle.reference.generate(ids, attention_mask=torch.ones_like(ids),
                                            do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
            expected[p.req_id] = out[0, ids.shape[1]:].tolist()
    return prompts, expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("overlap", "draft_len", "rate"), [
    (False, 0, None), (False, 3, 0.5), (True, 0, None), (True, 3, 0.5)])
def test_shared_prefixes_hit_a_windowed_pool_with_the_exact_tokens(
        connect: Callable, one_thread: None, family: str, overlap: bool, draft_len: int,
        rate: float | None) -> None:
    """Prefix caching on a windowed pool: a released cached block is parked, not poisoned
    (the pool's protected mask keeps it), and a later prompt's hit reads only the blocks of
    its window: tokens equal generate's, and whole shared blocks were skipped."""
    oracle = make_oracle(family)
    prompts, expected = shared_prefixes(family)
    config = pool_config(oracle.model, window=WINDOW).model_copy(
        update={"prefix_caching": True})
    client = connect(config, overlap=overlap)
    client.pool.kv.fill_(float("nan"))
    gives = GiveBacks(client, torch.empty_like(client.pool.kv))
    drafter = None if rate is None else DeviceOracleDrafter(
        expected, rate, vocab_size=oracle.model.config.vocab_size, device="cpu", seed=3)
    engine = Engine(oracle.model, client, drafter, draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), overlap=overlap, validate=True,
                    share_prefixes=True)
    assert engine.run(prompts, MAX_NEW_TOKENS) == expected
    stats = engine.stats
    assert stats.cached_prompt_tokens > 0 and stats.cached_prompt_tokens % 4 == 0
    assert stats.table_violations == 0
    assert gives.released > 0 and gives.poisoned > 0
