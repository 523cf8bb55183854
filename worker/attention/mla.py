"""DeepSeek-V3's attention module (MLA) over a latent pool: its forward, switched per instance.

transformers' ``DeepseekV3Attention`` expands the latent cache into per-head keys and values
and hands them to the attention interface; a latent pool holds only the latent, so the hook
(`worker.attention.hook`) cannot serve it. `switch_mla_modules(model)` points every such module
at `_forward`, which for a step of the pool (a `PoolStep` passed) runs `mla_attention`:

1. the query as transformers computes it (``q_proj``, or ``q_a_proj``, ``q_a_layernorm`` and
   ``q_b_proj`` with a q LoRA rank), split into its no-rope and rope parts;
2. the latent: ``kv_a_proj_with_mqa`` split into ``c`` (through ``kv_a_layernorm``) and the
   rope key; the rope parts of query and key rotated by transformers' own functions, with the
   model's convention (DeepSeek's interleaved pairs where ``rope_interleave``);
3. ``[c | k_rope]`` staged at ``staging[layer, 0, i, 0]`` for token ``i`` (the commit writes
   the pool from there);
4. the absorbed attention (`worker.attention.latent_attention`: the kernel where it takes the
   step, else the reference) at the module's own ``scaling`` (yarn's mscale included), with
   the config's ``sliding_window`` when it carries one, each head's ``W_UV`` and ``o_proj``.

Every other call (no step, a cache, training) keeps the module's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from kvalloc.worker.attention.hook import PoolStep
from kvalloc.worker.attention.latent_attention import (
    absorb_query,
    absorbed_weights,
    expand_output,
    latent_attention,
)
from kvalloc.worker.attention.latent_attention_triton import kernel_takes, latent_attention_triton
from kvalloc.worker.errors import KvallocAttentionError
from kvalloc.worker.module_forwards import switch_forwards
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

# DeepSeek-V2's module rotates with complex frequencies of its own: not served here.
MLA_CLASSES = ("DeepseekV3Attention",)


def switch_mla_modules(model: torch.nn.Module) -> int:
    """Point every MLA attention module of ``model`` at the latent pool's forward; returns how
    many it switched (none the second time)."""
    return switch_forwards(model, MLA_CLASSES, _forward)


def mla_attention(module: torch.nn.Module, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor],
                  step: PoolStep) -> torch.Tensor:
    """The module's output for one packed step, ``hidden_states [1, N, hidden]``."""
    n, layer, heads = step.num_tokens, module.layer_idx, module.num_heads
    nope, rope, rank = module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    x = hidden_states[0]
    if module.q_lora_rank is None:
        q = module.q_proj(x)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
    q_nope, q_rope = q.view(n, heads, nope + rope).split([nope, rope], dim=-1)
    c, k_rope = module.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
    c = module.kv_a_layernorm(c)
    cos, sin = position_embeddings
    rotate = (apply_rotary_pos_emb_interleave if module.config.rope_interleave
              else apply_rotary_pos_emb)
    q_rope, k_rope = rotate(q_rope, k_rope[:, None], cos[0], sin[0])
    staged = step.staged(layer, 0)  # [N, 1, rank + rope]
    staged[:, 0, :rank].copy_(c)
    staged[:, 0, rank:].copy_(k_rope[:, 0])
    w_uk, w_uv = absorbed_weights(module.kv_b_proj.weight, heads, nope, module.v_head_dim)
    q_latent = absorb_query(q_nope, w_uk)
    # transformers' DeepSeek-V3 has no window; a config that carries one (DeepSeek-V4's
    # latent cache slides) windows every layer.
    window = getattr(module.config, "sliding_window", None)
    out = expand_output(attend_latent(step, layer, q_latent, q_rope.contiguous(),
                                      module.scaling, window), w_uv)
    return module.o_proj(out.reshape(1, n, -1))


def attend_latent(step: PoolStep, layer: int, q_latent: torch.Tensor, q_rope: torch.Tensor,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """``[N, H, R]``: the kernel where it takes the step, else the reference (``q_latent``
    itself for a step that does not attend)."""
    if not step.attend:
        return q_latent
    pool, layout = step.pool(layer, 0), step.layout(layer)
    kernel = kernel_takes(q_latent, pool)
    if not kernel and q_latent.is_cuda and torch.cuda.is_current_stream_capturing():
        raise KvallocAttentionError(
            f"cuda_graphs: a captured step needs the latent attention kernel, which does not "
            f"take {q_latent.dtype} queries over a {pool.dtype} pool (or Triton is missing)")
    return (latent_attention_triton if kernel else latent_attention)(
        q_latent, q_rope, step.staged(layer, 0), pool, layout, scale=scale, window=window)


def _forward(module: torch.nn.Module, hidden_states: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[Any, Any]:
    step = kwargs.get("kvalloc_step")
    if (isinstance(step, PoolStep) and kwargs.get("cache") is None and not module.training
            and position_embeddings is not None):
        if hidden_states.shape[:2] != (1, step.num_tokens):
            raise KvallocAttentionError(
                f"hidden_states: expected one packed sequence of {step.num_tokens} tokens, got "
                f"shape {tuple(hidden_states.shape)}")
        return mla_attention(module, hidden_states, position_embeddings, step), None
    return type(module).forward(module, hidden_states, position_embeddings, attention_mask,
                                **kwargs)
