"""Draft proposers for speculative decoding: each proposes up to ``num`` next tokens.

- `NgramDrafter` (prompt lookup, as in vLLM's ``ngram`` method and transformers'
  ``prompt_lookup_num_tokens``): find the longest recent n-gram that ends the context earlier in
  it and propose what followed that earlier occurrence. Needs no model; strong on inputs that
  repeat themselves (code, extraction, summaries).
- `OracleDrafter`: proposes the true greedy continuation (computed beforehand) with each token
  replaced by a wrong one at a given rate, so tests and benchmarks can set acceptance anywhere
  from 0 to 100%. `DeviceOracleDrafter` is the same on the device, for a worker that drafts
  step k before the host has read step k-1's tokens (an overlap worker): a gather from the truth
  at each row's device-side count of emitted tokens.

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
    """`OracleDrafter` on the device. ``truth`` as there; its random draws come from a torch
    generator on ``device``, so the wrong tokens differ from `OracleDrafter`'s (the tokens a
    greedy worker emits do not)."""

    def __init__(self, truth: Mapping[str, Sequence[int]], rate: float, *, vocab_size: int,
                 device: torch.device, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise DrafterSpecError(f"oracle: rate {rate} is not in [0, 1]")
        self.truth = {k: np.asarray(v, dtype=np.int64) for k, v in truth.items()}
        self.width = max((v.size for v in self.truth.values()), default=0)
        self.rate, self.vocab_size = rate, vocab_size
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def truth_rows(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[len(req_ids), width]``: each request's truth, padded with 0."""
        rows = np.zeros((len(req_ids), self.width), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            t = self.truth[req_id]
            rows[i, :t.size] = t
        return rows

    def draft(self, truth: torch.Tensor, generated: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(generated), width]`` drafts: row ``r`` follows its ``generated[r]`` emitted
        tokens (``truth [R, W]``, one row per drafting request)."""
        at = (generated[:, None] + torch.arange(width, device=truth.device)).clamp_(
            max=truth.shape[1] - 1)
        true = truth.gather(1, at)
        wrong = torch.rand(true.shape, generator=self.generator,
                           device=truth.device) >= self.rate
        shift = torch.randint(1, max(self.vocab_size, 2), true.shape, generator=self.generator,
                              device=truth.device)
        return torch.where(wrong, (true + shift) % self.vocab_size, true)


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
