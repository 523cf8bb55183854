"""What a captured decode step needs of the model: a mixture-of-experts forward that reads
nothing back to the host."""

from __future__ import annotations

import torch
from kvalloc.worker.model import random_model
from kvalloc.worker.step.decode_graphs import GRAPH_SAFE_EXPERTS, make_capturable

from tests.worker.worker_oracle import CONFIGS


def test_a_moe_model_switches_to_the_graph_safe_experts_and_computes_the_same() -> None:
    model = random_model(CONFIGS["deepseek_v3"], seed=0)
    model.set_attn_implementation("sdpa")
    tokens = torch.arange(1, 12).unsqueeze(0)
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        before = model(tokens).logits
        make_capturable(model)
        after = model(tokens).logits
    assert model.config._experts_implementation == GRAPH_SAFE_EXPERTS
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_a_model_without_experts_is_left_as_it_is() -> None:
    model = random_model(CONFIGS["llama"], seed=0)
    before = model.config._experts_implementation
    make_capturable(model)
    assert model.config._experts_implementation == before
