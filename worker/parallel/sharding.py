"""A loaded transformers model turned into one tensor-parallel rank's shard, Megatron style.

In every decoder layer rank ``r`` of ``world`` keeps
- the rows of q/k/v (weights and biases) of its heads (`worker.parallel.split`): it attends
  with its query heads over its own KV heads, the ones it stages and its pool shard holds;
- the columns of o_proj of its query heads: its product is a partial sum, which
  `RowParallelLinear` sums over the process group before adding the bias, once;
- the MLP split alike: gate/up by rows, down_proj by columns and summed.
Embeddings, norms, the rotary tables and lm_head stay whole on every rank, so each rank ends a
forward with the full logits.

The config every module of the model shares describes the shard: query heads, KV heads and the
intermediate size divided by ``world``, ``head_dim`` pinned (Qwen2 derives it from
``hidden_size // num_attention_heads``), so `worker.model.kv_shape` of it is the rank's pool
shard. The attention modules' own numbers (``head_dim``, ``num_key_value_groups``,
``scaling``) are ratios an equal split keeps.

Inference only: the sums are torch.distributed collectives, which autograd does not see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from kvalloc.worker.errors import ShardingError
from kvalloc.worker.model import GQA_FAMILIES, kv_shape
from kvalloc.worker.parallel.split import shard_kv_heads, shard_query_heads, shard_range
from torch import nn
from torch.distributed import ProcessGroup
from transformers import PretrainedConfig, PreTrainedModel


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over a process group: this rank holds the
    weight's columns of its features, and the ranks' partial products are summed. The bias is
    whole on every rank and added after the sum, so the sum holds it once."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 group: ProcessGroup | None) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        self.group = group  # None: the default process group

    @classmethod
    def from_linear(cls, linear: nn.Linear, columns: slice,
                    group: ProcessGroup | None) -> RowParallelLinear:
        """This rank's part of ``linear``: the input features ``columns``."""
        layer = cls(columns.stop - columns.start, linear.out_features,
                    bias=linear.bias is not None, group=group)
        layer.weight = _copy_param(linear.weight, linear.weight[:, columns])
        if linear.bias is not None:
            layer.bias = _copy_param(linear.bias, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
        return partial if self.bias is None else partial + self.bias


@dataclass(frozen=True)
class _Shard:
    """What a rank keeps, as slices of the full layers' features."""

    query: slice  # q_proj's output rows, o_proj's input columns
    kv: slice  # k_proj's and v_proj's output rows
    mlp: slice  # gate_proj's and up_proj's rows, down_proj's columns
    head_dim: int

    @classmethod
    def of(cls, config: PretrainedConfig, rank: int, world: int) -> _Shard:
        heads = config.num_attention_heads
        _, kv_heads, head_dim = kv_shape(config)
        q_start, q_stop = shard_query_heads(heads, kv_heads, rank, world)
        kv_start, kv_stop = shard_kv_heads(kv_heads, rank, world)
        mlp = slice(*shard_range("intermediate_size", config.intermediate_size, rank, world))
        return cls(slice(q_start * head_dim, q_stop * head_dim),
                   slice(kv_start * head_dim, kv_stop * head_dim), mlp, head_dim)


def shard_model(model: PreTrainedModel, rank: int, world: int,
                group: ProcessGroup | None = None) -> PreTrainedModel:
    """Turn ``model`` in place into rank ``rank``'s shard of ``world`` and return it.

    ``group`` (default: the default process group) is what the row-split layers sum over: this
    process must be its rank ``rank`` of ``world``. Everything is checked before anything
    changes; a `ShardingError` names the field and the numbers."""
    config = model.config
    # A latent pool has one head a layer: nothing to split by heads.
    if config.model_type not in GQA_FAMILIES:
        raise ShardingError(f"model_type: {config.model_type!r} cannot be sharded; "
                            f"supported: {', '.join(GQA_FAMILIES)}")
    shard = _Shard.of(config, rank, world)
    _check_group(group, rank, world)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, shard, group)
        _shard_mlp(layer.mlp, shard, group)
    _shard_config(config, shard)
    return model


def _check_group(group: ProcessGroup | None, rank: int, world: int) -> None:
    if not dist.is_initialized():
        raise ShardingError("group: torch.distributed has no process group; start the ranks "
                            "with worker.parallel.local_ranks or init_process_group")
    own, size = dist.get_rank(group), dist.get_world_size(group)
    if (own, size) != (rank, world):
        raise ShardingError(f"rank: rank {rank} of {world} asked for, but this process is rank "
                            f"{own} of {size} in the process group")


def _shard_attention(attn: nn.Module, shard: _Shard, group: ProcessGroup | None) -> None:
    _keep_rows(attn.q_proj, shard.query)
    _keep_rows(attn.k_proj, shard.kv)
    _keep_rows(attn.v_proj, shard.kv)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, shard.query, group)


def _shard_mlp(mlp: nn.Module, shard: _Shard, group: ProcessGroup | None) -> None:
    _keep_rows(mlp.gate_proj, shard.mlp)
    _keep_rows(mlp.up_proj, shard.mlp)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, shard.mlp, group)
    mlp.intermediate_size = shard.mlp.stop - shard.mlp.start


def _shard_config(config: PretrainedConfig, shard: _Shard) -> None:
    # Pinned: a config without head_dim (Qwen2) derives it from the heads, which now shrink.
    config.head_dim = shard.head_dim
    config.num_key_value_heads = (shard.kv.stop - shard.kv.start) // shard.head_dim
    config.num_attention_heads = (shard.query.stop - shard.query.start) // shard.head_dim
    config.intermediate_size = shard.mlp.stop - shard.mlp.start


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    """``linear`` computes only the output features ``rows``."""
    linear.weight = _copy_param(linear.weight, linear.weight[rows])
    if linear.bias is not None:
        linear.bias = _copy_param(linear.bias, linear.bias[rows])
    linear.out_features = rows.stop - rows.start


def _copy_param(like: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
    """A parameter of its own (the full tensor it was sliced from can be freed)."""
    return nn.Parameter(values.detach().clone(), requires_grad=like.requires_grad)
