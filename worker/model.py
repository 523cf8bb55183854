"""Loading the causal LM the worker serves: a local checkpoint, or random weights from a config.

Both paths give an unmodified `transformers` model in eval mode, on the requested device and
dtype, with the kvalloc attention selected. Nothing is downloaded: a checkpoint must be a local
directory (or already in the local Hugging Face cache).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from kvalloc.allocator import LayerGroup, PoolConfig
from kvalloc.worker.arguments import DTYPE_NAMES
from kvalloc.worker.attention.hook import ATTN_IMPLEMENTATION, register
from kvalloc.worker.errors import ModelLoadError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

# Decoder-only families whose attention is plain (optionally grouped-query) softmax attention
# over rotary positions, which is what the pool path implements: per-head K/V planes.
GQA_FAMILIES = ("llama", "mistral", "qwen2")
# Families with multi-head latent attention: a latent pool (`worker.attention.mla`).
LATENT_FAMILIES = ("deepseek_v3",)
SUPPORTED_FAMILIES = GQA_FAMILIES + LATENT_FAMILIES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def config_from_file(path: str | Path) -> PretrainedConfig:
    """A transformers config from a JSON file with a ``model_type`` (e.g. ``"llama"``)."""
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model_config: cannot read {path}: {exc}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelLoadError(f"model_config: {path} must be a JSON object with a model_type")
    model_type = fields.pop("model_type")
    _check_family(model_type, "model_config")
    return AutoConfig.for_model(model_type, **fields)


def random_model(config: PretrainedConfig, *, seed: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> PreTrainedModel:
    """A model with ``config``'s shape and weights drawn from ``seed`` (same seed, same
    weights)."""
    _check_family(config.model_type, "model_config")
    register()
    torch.manual_seed(seed)
    # A copy: transformers keeps the attention choice on the config, and a caller may switch
    # another model built from the same config to a plain implementation.
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype,
                                             attn_implementation=ATTN_IMPLEMENTATION)
    return model.to(device).eval()


def load_model(path_or_id: str, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> PreTrainedModel:
    """A checkpoint transformers can load, from a local directory or the local cache only."""
    _check_directory(path_or_id)
    register()
    try:
        config = AutoConfig.from_pretrained(path_or_id, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model: cannot load {path_or_id!r} locally: {exc}") from None
    _check_family(config.model_type, "model")
    model = AutoModelForCausalLM.from_pretrained(
        path_or_id, dtype=dtype, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION)
    return model.to(device).eval()


def _check_directory(path_or_id: str) -> None:
    """A name spelled as a path (``/``, ``.`` or ``~`` first) names a directory that must exist:
    transformers would take a missing one for a hub id and answer with the rules of ids."""
    path = Path(path_or_id).expanduser()
    if not path_or_id.startswith(("/", ".", "~")) and not path.exists():
        return  # a model id, looked up in the local cache
    if not path.exists():
        raise ModelLoadError(f"model: directory {path_or_id} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model: {path_or_id} is not a directory (a checkpoint is one)")


def kv_layout(config: PretrainedConfig) -> str:
    """The pool layout a model's KV takes (`PoolConfig.kv_layout`)."""
    return "latent" if config.model_type in LATENT_FAMILIES else "kv"


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a model's KV cache; a latent cache has one
    head, as wide as the compressed KV and the rope key together."""
    if kv_layout(config) == "latent":
        return config.num_hidden_layers, 1, config.kv_lora_rank + config.qk_rope_head_dim
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window in positions (None: it reads its whole history), read the
    way its family's forward reads it: Mistral slides every layer by ``sliding_window``; Qwen2
    the layers ``layer_types`` names ``sliding_attention``; a latent model every layer when its
    config carries a ``sliding_window`` (transformers' DeepSeek-V3 has none; DeepSeek-V4's
    latent cache is windowed)."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if config.model_type == "llama" or window is None:
        return (None,) * layers
    if kinds is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return (window,) * layers


def pool_window(config: PretrainedConfig, layers: Sequence[int] | None = None) -> int | None:
    """The window a pool of ``layers`` (by default every layer) may give back blocks behind
    for this model: its widest layer's when every one slides, else None (a full-attention
    layer reads every block)."""
    windows = layer_windows(config)
    if layers is not None:
        windows = tuple(windows[layer] for layer in layers)
    return None if None in windows else max(windows)  # type: ignore[type-var]


def model_groups(config: PretrainedConfig, *, num_blocks: int) -> list[LayerGroup]:
    """The groups of a pool for a model that mixes layer kinds: one of its full-attention
    layers (``full``), one per distinct window (``window<W>``), each of ``num_blocks`` blocks;
    none for a model whose layers are all of one kind (one pool of every layer, with
    `pool_window`)."""
    windows = layer_windows(config)
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(kinds) < 2:
        return []
    return [LayerGroup(name="full" if w is None else f"window{w}",
                       layers=tuple(i for i, have in enumerate(windows) if have == w),
                       window=w, num_blocks=num_blocks) for w in kinds]


def sized_groups(config: PretrainedConfig, pool: PoolConfig, *, num_requests: int,
                 max_step_tokens: int) -> list[LayerGroup]:
    """`model_groups` for ``pool`` (none for a model of one layer kind): the full group of
    ``pool``'s blocks, each windowed group of those its window needs for ``num_requests`` at
    once, never more than ``pool``'s: per request what a decoding row holds at most
    (`PoolConfig.max_live_blocks_per_seq`), and for the prefill chunks of the two steps in
    flight (at most ``max_step_tokens`` each, over every request) their blocks and one more
    per request for where they start in a block, twice. Fewer blocks defer or preempt
    requests; they never change what a request reads."""
    groups = model_groups(config, num_blocks=pool.total_blocks)
    tokens_per_block = pool.tokens_per_block
    chunks = -(-2 * max_step_tokens // tokens_per_block) + 2 * num_requests
    return [g if g.window is None else g.model_copy(update={"num_blocks": min(
        pool.total_blocks, num_requests * pool.model_copy(
            update={"window": g.window}).max_live_blocks_per_seq + chunks)})
        for g in groups]


def pool_for_model(config: PretrainedConfig, *, longest: int, num_requests: int,
                   draft_len: int, dtype: str, device: str, tokens_per_block: int = 16,
                   max_batch_size: int = 64, num_blocks: int | None = None,
                   slack_policy: str = "reclaim", window: int | None = None) -> PoolConfig:
    """A pool shaped like the model's KV whose rows hold ``longest`` tokens (prompt + output);
    by default with blocks for ``num_requests`` such requests at once. ``window``: a windowed
    pool's (`pool_window` gives a model's)."""
    layers, kv_heads, head_dim = kv_shape(config)
    per_request = -(-(longest + 1 + 2 * draft_len) // tokens_per_block)
    return PoolConfig(
        num_blocks=num_blocks or per_request * num_requests, tokens_per_block=tokens_per_block,
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
        kv_layout=kv_layout(config), dtype=dtype, device=device,
        max_batch_size=max_batch_size, max_seq_len=longest, max_draft_len=draft_len,
        overlap_scheduler=True, slack_policy=slack_policy, window=window)


def _check_family(model_type: str, field: str) -> None:
    if model_type not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"{field}: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_FAMILIES)}")
