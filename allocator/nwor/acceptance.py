"""Draft-token acceptance (`acceptance_mask`) and the SCV execution modes (`ScvAcceptor`).

`accept` is the product's one acceptance rule: the service's `verify_and_commit` and the
reference worker's greedy verification (`worker.step.device_step`) both call it, on the device,
graph-capturable. `acceptance_mask` is the same rule with its inputs checked first, and
`ScvAcceptor` runs it in one of the SCV modes below, for an engine that verifies through the
library outside a captured step of its own.

A request's draft token j is accepted iff drafts 0..j all equal the target model's sampled token at
the same position: the mask is true up to the first mismatch (a cumulative product over each
request's segment) and the count is the mask's length. Everything is vectorised over the batch,
stays on the device and never synchronises with the host; ``counts.tolist()`` is the caller's
choice.

Inputs (any integer dtype, one device):
- ``sampled_ids``: ``[batch, width]``, row r holding the target's token for each draft position
  (extra columns ignored). A rejection sampler's ``[batch, max_spec_len + 1]`` output padded with -1
  fits as is: after the first rejection it holds the recovered token and then -1, both of which
  differ from the draft, so the count is unchanged.
- ``draft_ids``: either flat ``[sum(num_draft_tokens)]`` (each request's drafts back to back) or
  padded ``[batch, max_drafts]`` with ``max_drafts <= width``. The mask comes back in that
  layout.
- ``num_draft_tokens``: drafts per request (0 allowed). A list, numpy array or CPU tensor is
  validated on the host; a device tensor is trusted (reading it back would synchronise).

SCV mode (``KVALLOC_SCV_MODE``, read when an `ScvAcceptor` is built): ``off`` runs eagerly;
``graph`` replays one CUDA graph per padded shape bucket (batch and width rounded up to powers of
two, so a handful of graphs serve every step) from static buffers, in a bounded LRU cache; a bucket
whose capture or replay fails falls back to eager for good and is counted, never returning a mask it
did not compute; ``adaptive`` times eager against replay once per bucket and keeps the faster. On a
CPU every mode runs eagerly.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch
from kvalloc.allocator.common.device_io import capture_graph, upload_int64
from kvalloc.allocator.errors import InvalidScvMode, NworInputError

SCV_MODE_ENV = "KVALLOC_SCV_MODE"
# Why a shape bucket fell back to eager for good (the keys of `ScvStats.fallbacks`), every one
# named here so the metrics serve each at 0 before its first fallback.
CAPTURE_FAILED, REPLAY_FAILED = "capture_failed", "replay_failed"
FALLBACK_REASONS = (CAPTURE_FAILED, REPLAY_FAILED)

DraftCounts = Sequence[int] | np.ndarray | torch.Tensor


class ScvMode(str, Enum):
    OFF = "off"
    GRAPH = "graph"
    ADAPTIVE = "adaptive"


def parse_scv_mode(value: str | ScvMode) -> ScvMode:
    """``value`` as an `ScvMode`; anything else raises `InvalidScvMode` naming the variable."""
    try:
        return ScvMode(str(value.value if isinstance(value, ScvMode) else value).strip().lower())
    except ValueError:
        choices = " | ".join(m.value for m in ScvMode)
        raise InvalidScvMode(f"{SCV_MODE_ENV}={value!r}: must be one of {choices}") from None


def scv_mode_from_env(environ: Mapping[str, str] | None = None) -> ScvMode:
    """The SCV mode from ``KVALLOC_SCV_MODE`` (default ``off``)."""
    env = os.environ if environ is None else environ
    return parse_scv_mode(env.get(SCV_MODE_ENV, ScvMode.OFF.value))


def acceptance_mask(draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
                    num_draft_tokens: DraftCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, counts)``: bool mask in ``draft_ids``' layout, true up to each request's first
    mismatch; int64 ``counts[batch]`` (accepted drafts per request) on the inputs' device."""
    return accept(draft_ids, sampled_ids,
                  checked_draft_counts(draft_ids, sampled_ids, num_draft_tokens))


def accept(draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
           num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`acceptance_mask` on inputs `checked_draft_counts` has validated (``num_draft``: its
    int64 device tensor). Device operations only: graph-capturable."""
    if draft_ids.dim() == 1:
        return _flat_acceptance(draft_ids, sampled_ids, num_draft)
    return _padded_acceptance(draft_ids, sampled_ids, num_draft)


def _padded_counts(draft: torch.Tensor, sampled: torch.Tensor, num_draft: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Per request: the leading run of matches (cumulative product), capped at its drafts.
    Four kernels, so a captured verify step stays short."""
    leading = torch.cumprod(draft == sampled[:, : draft.shape[1]], dim=1, dtype=torch.int32)
    return torch.minimum(leading.sum(dim=1), num_draft, out=out)


def _padded_acceptance(draft: torch.Tensor, sampled: torch.Tensor,
                       num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts = _padded_counts(draft, sampled, num_draft)
    return torch.arange(draft.shape[1], device=draft.device) < counts[:, None], counts


def _flat_acceptance(draft: torch.Tensor, sampled: torch.Tensor,
                     num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat drafts: find each token's request and position, scatter the matches into a padded
    ``[batch, width]`` grid, take the per-row cumulative product, and read the mask back.

    Tokens at flat index >= sum(num_draft) (static-shape padding in a graph) belong to no request.
    """
    batch, width = sampled.shape
    device = draft.device
    if batch == 0 or width == 0:
        return torch.zeros(draft.shape, dtype=torch.bool, device=device), torch.zeros(
            batch, dtype=torch.int64, device=device)
    ends = torch.cumsum(num_draft, dim=0)  # inclusive: request r owns [ends[r] - n[r], ends[r])
    t = torch.arange(draft.shape[0], device=device)
    # right=True: flat index ends[r] is the first token of a later request. Searching this
    # inclusive sum with side='left' gave every request after the first its predecessor's tokens.
    req = torch.searchsorted(ends, t, right=True)
    in_batch = req < batch
    req = req.clamp(max=batch - 1)
    pos = t - (ends[req] - num_draft[req])
    target = sampled[req, pos.clamp(0, width - 1)]
    match = (draft == target) & in_batch
    grid = torch.zeros((batch, width + 1), dtype=torch.int32, device=device)
    # Out-of-batch tokens (and, from unvalidated device counts, drafts past the sampled width)
    # land in the scratch column `width`: never on a real position, never out of bounds.
    grid[req, torch.where(in_batch & (pos < width), pos, width)] = match.to(torch.int32)
    counts = grid[:, :width].cumprod(dim=1).sum(dim=1)
    return (pos < counts[req]) & in_batch, counts


def is_integer_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers: NWOR's counts and ids take any integer dtype, never a bool
    (a mask is not a count), a float or a complex."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def checked_draft_counts(draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
                         num_draft_tokens: DraftCounts) -> torch.Tensor:
    """Validate the inputs; return the draft counts as int64 on the inputs' device."""
    host = validate_inputs(draft_ids, sampled_ids, num_draft_tokens)
    if host is None:
        assert isinstance(num_draft_tokens, torch.Tensor)
        return num_draft_tokens.to(torch.int64)
    return upload_int64(host, sampled_ids.device)


def validate_inputs(draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
                    num_draft_tokens: DraftCounts) -> np.ndarray | None:
    """Check shapes, dtypes and devices, and host-known counts against them; return the counts
    on the host, or None when they are a (trusted: never read back) device tensor."""
    for name, t in (("sampled_ids", sampled_ids), ("draft_ids", draft_ids)):
        if not isinstance(t, torch.Tensor) or not is_integer_tensor(t):
            raise NworInputError(f"{name}: must be an integer tensor", field=name)
    if sampled_ids.dim() != 2:
        raise NworInputError(
            f"sampled_ids: shape {tuple(sampled_ids.shape)}, expected [batch, width]",
            field="sampled_ids")
    if draft_ids.device != sampled_ids.device:
        raise NworInputError(
            f"draft_ids: on {draft_ids.device}, sampled_ids on {sampled_ids.device}",
            field="draft_ids")
    batch, width = sampled_ids.shape
    if draft_ids.dim() == 2:
        if draft_ids.shape[0] != batch or draft_ids.shape[1] > width:
            raise NworInputError(
                f"draft_ids: shape {tuple(draft_ids.shape)} does not fit sampled_ids "
                f"{tuple(sampled_ids.shape)} (needs [batch, <= width])", field="draft_ids")
        max_drafts = draft_ids.shape[1]
    elif draft_ids.dim() == 1:
        max_drafts = width
    else:
        raise NworInputError(
            f"draft_ids: {draft_ids.dim()}-D, expected flat [total] or [batch, max_drafts]",
            field="draft_ids")

    device = sampled_ids.device
    if isinstance(num_draft_tokens, torch.Tensor) and num_draft_tokens.device.type != "cpu":
        if num_draft_tokens.shape != (batch,) or not is_integer_tensor(num_draft_tokens):
            raise NworInputError(
                f"num_draft_tokens: expected an integer tensor of shape ({batch},)",
                field="num_draft_tokens")
        if num_draft_tokens.device != device:
            raise NworInputError(f"num_draft_tokens: on {num_draft_tokens.device}, expected "
                                 f"{device}", field="num_draft_tokens")
        return None

    counts = np.asarray(
        num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor)
        else num_draft_tokens)
    if counts.shape != (batch,) or (counts.size and counts.dtype.kind not in "iu"):
        raise NworInputError(
            f"num_draft_tokens: expected {batch} integers (one per sampled_ids row)",
            field="num_draft_tokens")
    if counts.size and (counts.min() < 0 or counts.max() > max_drafts):
        raise NworInputError(
            f"num_draft_tokens: every count must lie in [0, {max_drafts}]",
            field="num_draft_tokens")
    if draft_ids.dim() == 1 and draft_ids.shape[0] != int(counts.sum()):
        raise NworInputError(
            f"draft_ids: {draft_ids.shape[0]} flat tokens but num_draft_tokens sums to "
            f"{int(counts.sum())}", field="draft_ids")
    return counts


def _bucket(n: int, minimum: int) -> int:
    """``n`` rounded up to a power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


class StaticAcceptance:
    """Static buffers for one padded shape bucket, so the computation can be captured once and
    replayed with every batch that fits.

    Padding never changes a result: padded requests have 0 drafts, padded columns lie past every
    request's count, and padded flat tokens lie past the sum of the counts. Stale values left in
    the padding by earlier batches are therefore never read as a draft.
    """

    def __init__(self, *, flat: bool, batch: int, width: int, device: torch.device) -> None:
        self.flat, self.batch, self.width = flat, batch, width
        shape = (batch * width,) if flat else (batch, width)
        self.draft_ids = torch.zeros(shape, dtype=torch.int64, device=device)
        self.sampled_ids = torch.zeros((batch, width), dtype=torch.int64, device=device)
        self.num_draft = torch.zeros(batch, dtype=torch.int64, device=device)
        self.mask: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def fits(self, draft_ids: torch.Tensor, sampled_ids: torch.Tensor) -> bool:
        rows, width = sampled_ids.shape
        return (draft_ids.dim() == 1) == self.flat and rows <= self.batch and width <= self.width

    def load(self, draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
             num_draft: torch.Tensor) -> None:
        """Copy one batch into the buffers (device copies only)."""
        rows, width = sampled_ids.shape
        self.num_draft.zero_()
        self.num_draft[:rows].copy_(num_draft)
        self.sampled_ids[:rows, :width].copy_(sampled_ids)
        if self.flat:
            self.draft_ids[: draft_ids.shape[0]].copy_(draft_ids)
        else:
            self.draft_ids[:rows, : draft_ids.shape[1]].copy_(draft_ids)

    def compute(self) -> None:
        """The acceptance on the buffers; its outputs keep their memory across graph replays."""
        core = _flat_acceptance if self.flat else _padded_acceptance
        self.mask, self.counts = core(self.draft_ids, self.sampled_ids, self.num_draft)

    def compute_counts(self, out: torch.Tensor) -> None:
        """Only the accepted counts, into ``out`` (``[batch]``): what a verify step needs."""
        if self.flat:
            out.copy_(_flat_acceptance(self.draft_ids, self.sampled_ids, self.num_draft)[1])
        else:
            _padded_counts(self.draft_ids, self.sampled_ids, self.num_draft, out=out)

    def result(self, draft_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's ``(mask, counts)``, copied out so the next replay cannot overwrite them."""
        assert self.mask is not None and self.counts is not None
        mask = (self.mask[: draft_ids.shape[0]] if self.flat
                else self.mask[:rows, : draft_ids.shape[1]])
        return mask.clone(), self.counts[:rows].clone()


@dataclass
class ScvStats:
    eager_calls: int = 0
    graph_replays: int = 0
    captures: int = 0
    evictions: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    adaptive_choice: dict[tuple[bool, int, int], str] = field(default_factory=dict)


@dataclass
class _Bucket:
    static: StaticAcceptance
    graph: torch.cuda.CUDAGraph
    use_graph: bool | None  # None: adaptive mode has not measured this bucket yet


class ScvAcceptor:
    """`acceptance_mask` under an SCV mode; results are identical in every mode."""

    def __init__(self, mode: ScvMode | str | None = None, *, max_graphs: int = 16,
                 min_batch_bucket: int = 8, min_width_bucket: int = 4) -> None:
        self.mode = scv_mode_from_env() if mode is None else parse_scv_mode(mode)
        if max_graphs < 1:
            raise NworInputError("max_graphs: must be >= 1", field="max_graphs")
        self.max_graphs = max_graphs
        self.min_batch_bucket = min_batch_bucket
        self.min_width_bucket = min_width_bucket
        self.stats = ScvStats()
        self._buckets: OrderedDict[tuple[bool, int, int], _Bucket] = OrderedDict()
        self._failed: set[tuple[bool, int, int]] = set()

    def __call__(self, draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
                 num_draft_tokens: DraftCounts) -> tuple[torch.Tensor, torch.Tensor]:
        num_draft = checked_draft_counts(draft_ids, sampled_ids, num_draft_tokens)
        rows, width = sampled_ids.shape
        if self.mode is ScvMode.OFF or sampled_ids.device.type != "cuda" or 0 in (rows, width):
            return self._eager(draft_ids, sampled_ids, num_draft)
        key = (draft_ids.dim() == 1, _bucket(rows, self.min_batch_bucket),
               _bucket(width, self.min_width_bucket))
        bucket = self._bucket_for(key, sampled_ids.device)
        if bucket is None:
            return self._eager(draft_ids, sampled_ids, num_draft)
        try:
            if bucket.use_graph is None:
                bucket.use_graph = self._graph_is_faster(bucket, draft_ids, sampled_ids, num_draft)
                self.stats.adaptive_choice[key] = "graph" if bucket.use_graph else "eager"
            if not bucket.use_graph:
                return self._eager(draft_ids, sampled_ids, num_draft)
            bucket.static.load(draft_ids, sampled_ids, num_draft)
            bucket.graph.replay()
        except Exception:
            self._fail(key, REPLAY_FAILED)
            return self._eager(draft_ids, sampled_ids, num_draft)
        self.stats.graph_replays += 1
        return bucket.static.result(draft_ids, rows)

    @property
    def num_graphs(self) -> int:
        return len(self._buckets)

    def _eager(self, draft_ids: torch.Tensor, sampled_ids: torch.Tensor,
               num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.stats.eager_calls += 1
        return accept(draft_ids, sampled_ids, num_draft)

    def _bucket_for(self, key: tuple[bool, int, int], device: torch.device) -> _Bucket | None:
        if key in self._failed:
            return None
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        flat, batch, width = key
        static = StaticAcceptance(flat=flat, batch=batch, width=width, device=device)
        try:
            graph = capture_graph(static.compute)
        except Exception:
            self._fail(key, CAPTURE_FAILED)
            return None
        self.stats.captures += 1
        bucket = _Bucket(static, graph, None if self.mode is ScvMode.ADAPTIVE else True)
        self._buckets[key] = bucket
        if len(self._buckets) > self.max_graphs:
            self._buckets.popitem(last=False)
            self.stats.evictions += 1
        return bucket

    def _fail(self, key: tuple[bool, int, int], reason: str) -> None:
        self._failed.add(key)
        self._buckets.pop(key, None)
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1

    def _graph_is_faster(self, bucket: _Bucket, draft_ids: torch.Tensor,
                         sampled_ids: torch.Tensor, num_draft: torch.Tensor) -> bool:
        """Time both once for this bucket (the only host synchronisation adaptive mode makes)."""

        def replay() -> None:
            bucket.static.load(draft_ids, sampled_ids, num_draft)
            bucket.graph.replay()

        eager_s = time_cuda_ms(lambda: accept(draft_ids, sampled_ids, num_draft))
        graph_s = time_cuda_ms(replay)
        return graph_s < eager_s


def time_cuda_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds of ``fn()`` on the current stream, after one warm-up call (shared with
    the benchmarks, so adaptive SCV and the recorded figures time the same way)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters
