"""Draft proposers for speculative decoding: each proposes up to ``num`` next tokens.

- `NgramDrafter` (prompt lookup, as in vLLM's ``ngram`` method and transformers'
  ``prompt_lookup_num_tokens``): find the longest recent n-gram that ends the context earlier in
  it and propose what followed that earlier occurrence. Needs no model; strong on inputs that
  repeat themselves (code, extraction, summaries).
- `OracleDrafter`: proposes the true greedy continuation (computed beforehand) with each token
  replaced by a wrong one at a given rate, so tests and benchmarks can set acceptance anywhere
  from 0 to 100%. `DeviceOracleDrafter` is the same on the device, for a worker that drafts
  step k before the host has read step k-1's tokens (an overlap worker): a gather from the truth
  at each row's device-side count of emitted tokens, with counter-based draws (a hash of the
  row, the position and the seed), so that a captured CUDA graph drafts anew on each replay.

A drafter may propose fewer than ``num`` tokens (none at all when it has no guess); the engine
then grants that request a shorter draft.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from kvalloc.worker.errors import DrafterSpecError


class Drafter(Protocol):
    def propose(self, req_id: str, context: np.ndarray, num_generated: int,
                num: int) -> np.ndarray:
        """Up to ``num`` tokens to follow ``context`` (the prompt and the ``num_generated``
        tokens generated so far, the last of which is not yet in the KV)."""
        ...


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise DrafterSpecError(f"ngram: need 1 <= min_ngram ({min_ngram}) <= max_ngram "
                                   f"({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, req_id: str, context: np.ndarray, num_generated: int,
                num: int) -> np.ndarray:
        # Earlier positions holding the last token (never the last position itself, so a match
        # has a continuation); longer n-grams filter these candidates further. One pass over
        # the context per call, whatever max_ngram is.
        ends = np.flatnonzero(context[:-1] == context[-1])
        for n in range(min(self.max_ngram, context.size - 1), self.min_ngram - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[context[hits - back] == context[-1 - back]]
            if hits.size:
                start = int(hits[-1]) + 1  # after the most recent occurrence
                return context[start:start + num].copy()
        return context[:0].copy()


class OracleDrafter:
    """``rate``: the probability that a proposed token is the true one. ``truth`` maps each
    request id to its true greedy continuation (e.g. a non-speculative run's output)."""

    def __init__(self, truth: Mapping[str, Sequence[int]], rate: float, *, vocab_size: int,
                 seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise DrafterSpecError(f"oracle: rate {rate} is not in [0, 1]")
        self.truth = {k: np.asarray(v, dtype=np.int64) for k, v in truth.items()}
        self.rate, self.vocab_size = rate, vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, req_id: str, context: np.ndarray, num_generated: int,
                num: int) -> np.ndarray:
        true = self.truth[req_id][num_generated:num_generated + num]
        wrong = self.rng.random(true.size) >= self.rate
        # A shift in [1, vocab) always lands on another token.
        shift = self.rng.integers(1, self.vocab_size, size=true.size)
        return np.where(wrong, (true + shift) % self.vocab_size, true)


class DeviceOracleDrafter:
    """`OracleDrafter` on the device. ``truth`` as there. Whether a draft is wrong, and what it
    is then, are hashes of (seed, row, position): no generator state, so the draws hold inside
    a CUDA graph; the wrong tokens differ from `OracleDrafter`'s (the tokens a greedy worker
    emits do not). A step's drafts start after the last position any earlier step's acceptance
    saw, so each draft is still right with probability ``rate``, independently of the others."""

    def __init__(self, truth: Mapping[str, Sequence[int]], rate: float, *, vocab_size: int,
                 device: torch.device, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise DrafterSpecError(f"oracle: rate {rate} is not in [0, 1]")
        self.truth = {k: np.asarray(v, dtype=np.int64) for k, v in truth.items()}
        self.width = max((v.size for v in self.truth.values()), default=0)
        self.rate, self.vocab_size = rate, vocab_size
        self.device, self.seed = device, seed & _MASK
        self._right_below = round(rate * (_MASK + 1))  # a draw below it keeps the true token

    def truth_rows(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[len(req_ids), width]``: each request's truth, padded with 0."""
        rows = np.zeros((len(req_ids), self.width), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            t = self.truth[req_id]
            rows[i, :t.size] = t
        return rows

    def draft(self, truth: torch.Tensor, rows: torch.Tensor, generated: torch.Tensor,
              width: int) -> torch.Tensor:
        """``[len(rows), width]`` drafts: row ``rows[d]`` follows its ``generated[rows[d]]``
        emitted tokens (``truth [R, W]`` and ``generated [R]``: every row's)."""
        at = generated[rows][:, None] + torch.arange(width, device=truth.device)
        true = truth[rows].gather(1, at.clamp(max=truth.shape[1] - 1))
        key = (self.seed + rows[:, None] * _ROW + at * _POSITION) & _MASK
        wrong = _mix(key) >= self._right_below
        shift = 1 + _mix(key ^ _SECOND) % max(self.vocab_size - 1, 1)
        return torch.where(wrong, (true + shift) % self.vocab_size, true)


# Counter-based draws: 31-bit values whose products stay within int64.
_MASK = 0x7FFFFFFF
_ROW, _POSITION, _SECOND = 0x2545F49, 0x9E3779B, 0x5BD1E995 & 0x7FFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash of each of ``x`` (in ``[0, 2**31)``): two multiply-xorshift rounds."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK
    return x ^ (x >> 16)


def parse_drafter_spec(spec: str) -> tuple[str, float | None]:
    """``"ngram"`` -> ("ngram", None); ``"oracle:0.6"`` -> ("oracle", 0.6)."""
    name, _, arg = spec.partition(":")
    if name == "ngram" and not arg:
        return "ngram", None
    if name == "oracle":
        try:
            rate = float(arg)
        except ValueError:
            raise DrafterSpecError(f"drafter: {spec!r} needs a rate, e.g. oracle:0.6") from None
        if not 0.0 <= rate <= 1.0:
            raise DrafterSpecError(f"drafter: rate {rate} in {spec!r} is not in [0, 1]")
        return "oracle", rate
    raise DrafterSpecError(f"drafter: {spec!r} is not ngram or oracle:RATE")
