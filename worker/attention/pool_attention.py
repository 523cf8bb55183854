"""Two-source attention straight from the kvalloc pool, with the step's layout on the device.

One step packs every scheduled request's tokens back to back (an *entry* each). Entry ``r``
owns the packed tokens ``query_starts[r] .. + query_lens[r]`` at positions ``history[r] ..``;
its history (the positions below ``history[r]``) lives in the pool, read through block-table row
``rows[r]`` (or none: a padded entry on the spare row past the table, `worker.step.rows`, has
no history), and its own tokens of this step live in staging. Each query attends over both
sources in one softmax, causal among the step's tokens, and a sliding-window layer sees only the
last ``window`` positions (key ``j`` is visible to the query at position ``p`` iff
``p - window < j <= p``, as transformers' masks have it).

`PagedLayout` holds those per-entry columns as device tensors. ``history`` in particular may be
known only on the device: an overlap worker's entry starts after the drafts its unsettled step
accepted, which the host has not read yet. Nothing here reads a device value back, so the
attention never waits for the host, and the host needs only bounds (``max_query``,
``max_keys`` per group) that it knows without the device.

`pool_attention` is the plain torch form (any device, the reference); its Triton launches
(`worker.attention.pool_attention_triton`, the kernel in `worker.kernels.pool_attention`) read
the same layout and are tested against it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from kvalloc.allocator import slot_mapping
from kvalloc.allocator.common.device_io import upload_int64
from kvalloc.worker.errors import PoolAttentionInputError


@dataclass(frozen=True)
class EntryGroup:
    """Entries the reference attends together, padded to ``[g, max_query]`` queries and
    ``max_keys`` keys (bounds the host knows; a long prefill chunk gets a group of its own so it
    never pads a batch of decodes). Its gather indices are built once a step, not once a layer."""

    query_index: torch.Tensor  # int64 [g, Q]: packed index of each query (0 where padded)
    query_valid: torch.Tensor  # bool [g, Q]
    key_slot: torch.Tensor  # int64 [g, S]: pool slot of a history key, else -1
    key_packed: torch.Tensor  # int64 [g, S]: packed index of a staged key, else 0
    visible: torch.Tensor  # bool [g, Q, S]: causal visibility, before any window
    query_positions: torch.Tensor  # int64 [g, Q, 1]

    @classmethod
    def of(cls, layout: PagedLayout, entries: torch.Tensor, max_query: int,
           max_keys: int) -> EntryGroup:
        """``max_keys`` must be at least every member's ``history + query_len``."""
        device = entries.device
        i = torch.arange(max_query, device=device)
        j = torch.arange(max_keys, device=device)
        starts, lens = layout.query_starts[entries], layout.query_lens[entries]
        hist = layout.history[entries]
        query_valid = i[None, :] < lens[:, None]
        query_index = torch.where(query_valid, starts[:, None] + i[None, :], 0)
        in_history = j[None, :] < hist[:, None]
        staged = ~in_history & (j[None, :] < (hist + lens)[:, None])
        # A padded entry's spare row lies past the table; it has no history, so whatever row
        # stands in for it is never read.
        rows = layout.rows[entries].clamp(max=layout.block_table.shape[0] - 1)
        rows = rows[:, None].expand(-1, max_keys)
        table_slot = slot_mapping(layout.block_table, rows.reshape(-1),
                                  j.expand(entries.numel(), -1).reshape(-1),
                                  layout.tokens_per_block).view(entries.numel(), max_keys)
        # A history position past its row's blocks has no slot: it is never read (an engine
        # would read out of bounds there; the validator counts such positions).
        key_slot = torch.where(in_history, table_slot, -1)
        key_packed = torch.where(staged, starts[:, None] + j[None, :] - hist[:, None], 0)
        query_positions = (hist[:, None] + i[None, :])[..., None]
        visible = (((key_slot >= 0) | staged)[:, None, :] & (j <= query_positions)
                   & query_valid[..., None])
        return cls(query_index, query_valid, key_slot, key_packed, visible, query_positions)

    def visible_in(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.visible
        keys = torch.arange(self.visible.shape[-1], device=self.visible.device)
        return self.visible & (keys > self.query_positions - window)


@dataclass(frozen=True)
class HostBounds:
    """What the host knows of a step's entries without the device: each one's query length and
    ``reach`` (at least its history + query length), and the widest entry still batched with
    decodes by the reference (``group_width``)."""

    query_lens: np.ndarray
    reach: np.ndarray
    group_width: int

    @property
    def max_query(self) -> int:
        return int(self.query_lens.max()) if self.query_lens.size else 0


@dataclass(frozen=True)
class PagedLayout:
    """One step's entries in the pool's terms, on the pool's device (int64 columns ``[R]``)."""

    block_table: torch.Tensor  # int32 [max_batch_size, max_blocks_per_seq], -1 past a row's blocks
    tokens_per_block: int
    rows: torch.Tensor
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    history: torch.Tensor
    token_entry: torch.Tensor  # int64 [N]: the entry of each packed token
    bounds: HostBounds
    # Device columns derived from the host bounds (kernels' launch plans), uploaded once a step.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.token_entry.numel()

    @property
    def max_query(self) -> int:
        """No entry has more tokens this step (a host bound: kernels size grids by it)."""
        return self.bounds.max_query

    @classmethod
    def build(cls, block_table: torch.Tensor, tokens_per_block: int, *, rows: np.ndarray,
              query_starts: np.ndarray, query_lens: np.ndarray, starts: np.ndarray,
              lead: torch.Tensor | None = None, lead_bound: np.ndarray | int = 0,
              group_width: int) -> PagedLayout:
        """A step's layout from the service's reply (host arrays per entry) and, for an overlap
        worker, each entry's ``lead`` on the device (the drafts its unsettled step accepted: its
        history is ``starts + lead``), which the host bounds by ``lead_bound``. One upload."""
        token_entry = np.repeat(np.arange(query_lens.size), query_lens)
        packed = np.concatenate([rows, query_starts, query_lens, starts, token_entry])
        columns = upload_int64(packed, block_table.device)
        r = query_lens.size
        rows_t, starts_t, lens_t, history = (columns[k * r:(k + 1) * r] for k in range(4))
        if lead is not None:
            history = history + lead
        bounds = HostBounds(query_lens, starts + lead_bound + query_lens, group_width)
        return cls(block_table, tokens_per_block, rows_t, starts_t, lens_t, history,
                   columns[4 * r:], bounds)

    @functools.cached_property
    def groups(self) -> tuple[EntryGroup, ...]:
        """The reference's groups, built once a step on first use: entries of at most
        ``group_width`` tokens together, each longer one on its own."""
        lens, reach = self.bounds.query_lens, self.bounds.reach
        short = np.flatnonzero(lens <= self.bounds.group_width)
        members = ([short] if short.size else []) + [
            np.array([i]) for i in np.flatnonzero(lens > self.bounds.group_width)]
        return tuple(EntryGroup.of(self, upload_int64(m, self.rows.device), int(lens[m].max()),
                                   int(reach[m].max())) for m in members)

    def over(self, block_table: torch.Tensor, tokens_per_block: int) -> PagedLayout:
        """The same entries read through another block table: a grouped pool's group (its rows
        are the same requests, its columns its own blocks). The host-derived columns are the
        entries', so both layouts share them (`cached`); the reference's groups are the
        table's own."""
        layout = dataclasses.replace(self, block_table=block_table,
                                     tokens_per_block=tokens_per_block)
        object.__setattr__(layout, "_derived", self._derived)
        return layout

    def cached(self, key: Hashable, build: Callable[[], np.ndarray]) -> torch.Tensor:
        """``build()``'s int64 values on the layout's device, uploaded on first use of ``key``
        in this step only (a capture must see it used once before)."""
        if key not in self._derived:
            self._derived[key] = upload_int64(build(), self.rows.device)
        return self._derived[key]

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[N]``: the position of every packed token."""
        e = self.token_entry
        offset = torch.arange(self.num_tokens, device=e.device) - self.query_starts[e]
        return self.history[e] + offset

    def slots(self) -> torch.Tensor:
        """int64 ``[N]``: the pool slot every packed token commits to (-1 where its position lies
        past its row's blocks)."""
        return slot_mapping(self.block_table, self.rows[self.token_entry], self.positions,
                            self.tokens_per_block)


def pool_attention(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                    pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, *,
                    scale: float | None = None, window: int | None = None,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``query [N, Hq, D]``; ``staged_k`` / ``staged_v`` ``[>= N, Hkv, D]`` (packed token ``i``
    at row ``i``); ``pool_k`` / ``pool_v`` ``[num_blocks, tokens_per_block, Hkv, D]``. Returns
    ``[N, Hq, D]``. A key no query sees is zeroed after the gather, so a pool slot holding NaN
    (poison, another request's garbage) cannot reach the output through a masked weight.
    An fp8 pool needs its layer's ``k_scale`` / ``v_scale`` (one-element device tensors):
    a pool value is ``stored * scale``, dequantised in float32."""
    check_inputs(query, staged_k, staged_v, pool_k, pool_v, layout, window=window,
                 k_scale=k_scale, v_scale=v_scale)
    # One spare row past the step's tokens takes every padded query's output: indexing with a
    # boolean mask instead would make the host wait for the device in every layer.
    spare = query.shape[0]
    out = query.new_zeros((spare + 1, *query.shape[1:]))
    flat_k, flat_v = pool_k.flatten(0, 1), pool_v.flatten(0, 1)
    # An fp8 pool's attention runs in float32: rounding its dequantised values to the query's
    # dtype would add an error of the reference's own (the kernel scales scores instead).
    work = torch.float32 if k_scale is not None else query.dtype
    for group in layout.groups:
        visible = group.visible_in(window)
        used = visible.any(1)[..., None, None]  # [g, S, 1, 1]
        from_pool = (group.key_slot >= 0)[..., None, None]
        slot = group.key_slot.clamp(min=0)
        keys = torch.where(from_pool, _dequantised(flat_k[slot], k_scale),
                           staged_k[group.key_packed].to(work))
        values = torch.where(from_pool, _dequantised(flat_v[slot], v_scale),
                             staged_v[group.key_packed].to(work))
        keys = torch.where(used, keys, 0)
        values = torch.where(used, values, 0)
        # A padded query sees key 0 only, so its softmax stays finite; its output is dropped.
        first = torch.zeros_like(visible)
        first[..., 0] = True
        mask = torch.where(visible.any(-1, keepdim=True), visible, first)
        attended = F.scaled_dot_product_attention(
            query[group.query_index].to(work).transpose(1, 2), keys.transpose(1, 2),
            values.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
            enable_gqa=True)  # [g, Hq, Q, D]
        out[torch.where(group.query_valid, group.query_index, spare)] = attended.transpose(
            1, 2).to(out.dtype)
    return out[:spare]


def _dequantised(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return stored
    return stored.to(torch.float32) * scale.to(torch.float32)


def check_inputs(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                 pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, *,
                 window: int | None, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> None:
    """What both forms of the pool attention require of their inputs (shapes and dtypes only:
    nothing here reads a device value)."""
    if query.dim() != 3 or query.shape[0] != layout.num_tokens:
        reject("query", f"expected [{layout.num_tokens}, Hq, D] (one row per packed token), got "
                        f"{tuple(query.shape)}")
    heads, dim = query.shape[1:]
    for name, pool in (("pool_k", pool_k), ("pool_v", pool_v)):
        if pool.dim() != 4 or pool.shape[1] != layout.tokens_per_block or pool.shape[3] != dim:
            reject(name, f"expected [num_blocks, {layout.tokens_per_block}, Hkv, {dim}], got "
                         f"{tuple(pool.shape)}")
    kv_heads = pool_k.shape[2]
    if pool_v.shape != pool_k.shape or pool_v.dtype != pool_k.dtype or heads % kv_heads:
        reject("pool_v", f"K {pool_k.dtype} {tuple(pool_k.shape)} and V {pool_v.dtype} "
                         f"{tuple(pool_v.shape)} must agree, with {heads} query heads a "
                         f"multiple of {kv_heads} KV heads")
    for name, staged in (("staged_k", staged_k), ("staged_v", staged_v)):
        if (staged.dim() != 3 or staged.shape[0] < layout.num_tokens
                or staged.shape[1:] != (kv_heads, dim) or staged.dtype != query.dtype):
            reject(name, f"expected {query.dtype} [>= {layout.num_tokens}, {kv_heads}, {dim}], "
                         f"got {staged.dtype} {tuple(staged.shape)}")
    _check_pool_dtype(query.dtype, pool_k.dtype, k_scale, v_scale)
    if window is not None and window < 1:
        reject("window", f"a sliding window spans at least 1 position, got {window}")


def _check_pool_dtype(dtype: torch.dtype, pool_dtype: torch.dtype, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> None:
    fp8 = pool_dtype == torch.float8_e4m3fn
    if not fp8 and pool_dtype != dtype:
        reject("pool_k", f"a {pool_dtype} pool cannot serve {dtype} queries (the pool holds "
                         f"the model's dtype, or float8_e4m3fn with scales)")
    for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fp8 and (given is None or given.numel() != 1):
            reject(name, "an fp8 pool needs its layer's dequantisation scale, one element")
        if not fp8 and given is not None:
            reject(name, f"only an fp8 pool has scales; this one is {pool_dtype}")


def reject(field: str, message: str) -> NoReturn:
    """Raise the pool attention's input error for ``field``."""
    raise PoolAttentionInputError(f"{field}: {message}", field=field)
