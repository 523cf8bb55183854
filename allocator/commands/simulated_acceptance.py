"""`Acceptance`: how many of a simulated worker's drafts a step accepts, sampled.

What the step-level simulator (`kvalloc simulate`) and the load generator's simulated worker
(`kvalloc loadgen`) draw each forward's accepted count from, and what their ``--acceptance`` flag
parses. A real worker accepts what verifying its drafts against the model keeps.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass
class Acceptance:
    """Per-step accepted-draft sampler: ``geometric:P`` (each position accepted with probability
    P until the first rejection), ``fixed:K``, or ``uniform`` (0..D equally likely)."""

    kind: str
    value: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Acceptance:
        kind, _, arg = spec.partition(":")
        if kind == "uniform" and not arg:
            return cls("uniform")
        try:
            value = float(arg)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--acceptance: {spec!r} is not geometric:P, fixed:K or uniform") from None
        if kind == "geometric" and 0.0 <= value <= 1.0:
            return cls(kind, value)
        if kind == "fixed" and value >= 0 and value == int(value):
            return cls(kind, value)
        raise argparse.ArgumentTypeError(
            f"--acceptance: {spec!r} is not geometric:P (0<=P<=1), fixed:K (K>=0) or uniform")

    def sample(self, rng: np.random.Generator, draft_len: int, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, min(int(self.value), draft_len), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(0, draft_len + 1, size=n)
        hits = rng.random((n, draft_len)) < self.value
        return np.cumprod(hits, axis=1).sum(axis=1).astype(np.int64)
