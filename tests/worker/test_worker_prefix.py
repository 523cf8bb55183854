"""The worker with prefix caching (float32, CPU): prompts that share a prefix give the same tokens
with sharing on and off, and with it on the later prompts skip the cached prefill."""

from __future__ import annotations

from collections.abc import Callable

from kvalloc.worker.engine import Engine
from kvalloc.worker.requests import NamedPrompt
from worker_oracle import MAX_NEW_TOKENS, Oracle, pool_config

pytest_plugins = ["worker_fixtures"]


def test_shared_prefixes_give_the_same_tokens_and_skip_their_prefill(llama_oracle: Oracle,
                                                                     connect: Callable) -> None:
    base = llama_oracle.prompts[-1].token_ids  # 70 tokens
    # Four prompts of 40 tokens sharing their first 32: about one is admitted per step
    # (48-token steps), so later ones find an earlier one's blocks written and cached.
    prompts = [NamedPrompt(f"p{i}", base[:32] + base[40 + 2 * i : 48 + 2 * i]) for i in range(4)]
    outputs = {}
    for share in (False, True):
        config = pool_config(llama_oracle.model)
        client = connect(config.model_copy(update={"prefix_caching": share}))
        engine = Engine(llama_oracle.model, client, None, draft_len=0,
                        stop_token_ids=llama_oracle.stop_tokens(), share_prefixes=share)
        outputs[share] = engine.run(prompts, MAX_NEW_TOKENS)
        cached = engine.stats.cached_prompt_tokens
        # Whole shared prefixes (8 blocks) skipped, only with sharing on.
        assert (cached > 0) == share and cached % 32 == 0
    assert outputs[True] == outputs[False]
