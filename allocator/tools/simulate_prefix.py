"""A shared-prefix workload for `KVCacheManager` with prefix caching: many conversations share
one system prompt, and each turn's prompt continues the conversation so far (its previous prompt,
the reply to it, a new user message). It reports how many prompt tokens were found cached (the
prefill a worker skips), and what the LRU evicted when the pool ran short.

Turns arrive ``arrivals`` per step; each decodes ``osl`` tokens one per step, then its
conversation's next turn queues. Only prompt blocks are cached (generated tokens reach the
manager as counts), so a turn reuses the system prompt and every earlier turn's prompt blocks.

``window``: every layer attends over a sliding window of that many tokens (one windowed group,
`capacity.windows`): a turn's hit then needs only the cached blocks its window reads, and the
blocks its window passes stay cached (parked) until evicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from kvalloc.allocator.capacity.manager import KVCacheManager
from kvalloc.allocator.capacity.step.plan import StepPlan
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import OutOfBlocks

VOCAB = 32000


@dataclass(frozen=True)
class SharingSpec:
    conversations: int = 32
    turns: int = 3
    system_len: int = 512
    user_len: int = 64
    osl: int = 32
    arrivals: int = 2
    tokens_per_block: int = 16
    num_blocks: int = 4096
    max_batch_size: int = 16
    seed: int = 0
    window: int | None = None

    def pool_config(self) -> PoolConfig:
        longest = self.system_len + self.turns * (self.user_len + self.osl)
        return PoolConfig(num_blocks=self.num_blocks, tokens_per_block=self.tokens_per_block,
                          num_layers=1, num_kv_heads=1, head_dim=1, device="cpu",
                          max_batch_size=self.max_batch_size, max_seq_len=longest,
                          max_draft_len=1, window=self.window)


@dataclass(frozen=True)
class SharingResult:
    turns: int
    steps: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    evicted_blocks: int


def simulate_sharing(spec: SharingSpec, stop: Callable[[], bool] = lambda: False) -> SharingResult:
    manager = KVCacheManager(spec.pool_config(), prefix_caching=True)
    rng = np.random.default_rng(spec.seed)
    system = rng.integers(0, VOCAB, spec.system_len)
    context = [system] * spec.conversations  # each conversation's tokens so far
    waiting = deque((c, 0) for c in range(spec.conversations))
    running: dict[int, tuple[int, int, int]] = {}  # row -> (conversation, turn, tokens left)
    pending = np.zeros(0, dtype=np.int64)
    steps = turns_done = 0
    while (waiting or running) and not stop():
        steps += 1
        done = [row for row, (_, _, left) in running.items() if left == 0]
        for row in done:
            conversation, turn, _ = running.pop(row)
            reply = rng.integers(0, VOCAB, spec.osl)
            context[conversation] = np.concatenate([context[conversation], reply])
            turns_done += 1
            if turn + 1 < spec.turns:
                waiting.append((conversation, turn + 1))
        arriving = [waiting.popleft() for _ in range(min(spec.arrivals, len(waiting)))]
        prompts = [np.concatenate([context[c], rng.integers(0, VOCAB, spec.user_len)])
                   for c, _ in arriving]
        grants = np.array(sorted(running), dtype=np.int64)
        outcome = manager.step(StepPlan(
            result_rows=pending, num_accepted=np.zeros(pending.size, dtype=np.int64),
            finished_rows=np.array(done, dtype=np.int64), grant_rows=grants,
            draft_lens=np.zeros(grants.size, dtype=np.int64),
            prompt_lens=[p.size for p in prompts], prompt_tokens=prompts))
        pending = grants[outcome.granted]
        for row in pending.tolist():
            conversation, turn, left = running[row]
            running[row] = (conversation, turn, left - 1)
        for (conversation, turn), prompt, row in zip(arriving, prompts,
                                                     outcome.admitted_rows.tolist(), strict=True):
            if row < 0:  # no room now: it arrives again next step
                if not running:
                    raise OutOfBlocks(f"num_blocks: {spec.num_blocks} blocks cannot hold a "
                                      f"{prompt.size}-token prompt")
                waiting.appendleft((conversation, turn))
                continue
            context[conversation] = prompt
            running[row] = (conversation, turn, spec.osl)
    manager.check_invariants()
    c = manager.counters
    return SharingResult(turns=turns_done, steps=steps, prompt_tokens=c.prefix_queried_tokens,
                         cached_tokens=c.prefix_hit_tokens,
                         hit_rate=round(c.prefix_hit_tokens / max(1, c.prefix_queried_tokens), 4),
                         evicted_blocks=c.evicted_blocks)


def summary(result: SharingResult) -> dict:
    return asdict(result)
