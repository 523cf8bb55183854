"""The worker's one error tree: everything the worker raises on purpose is a `WorkerError`.

Each class also derives from the builtin (or allocator error) callers caught it as before the
tree had a root: input a kernel or the pool attention does not take, a bad prompt, drafter or
model is a ``ValueError``; the loop's `EngineError` (the service and the worker disagree, or the
work cannot proceed) is a ``RuntimeError``; `PoolAttentionInputError` is also the allocator's
`NworInputError`, so it carries the ``field`` at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvalloc.allocator import NworInputError

if TYPE_CHECKING:
    from kvalloc.worker.run_stats import RunStats


class WorkerError(Exception):
    """Base of every error the worker raises on purpose."""


# ---------------------------------------------------------------------- the loop and its ranks


class EngineError(WorkerError, RuntimeError):
    """The service and the worker disagree, or the work cannot proceed."""


class LayoutMismatch(EngineError):
    """The service's pool does not fit the model (layers, heads, head size or dtype)."""


class PoolTooSmall(EngineError):
    """A prompt cannot be admitted even with nothing else running."""


class RunStopped(EngineError):
    """Rank 0 stopped the run before this step; every rank raises it at the same step."""


class RankFailed(EngineError):
    """A rank raised, died or ran past the run's time limit; ``child_traceback`` is the text of
    its exception's traceback (empty when it died without one)."""

    def __init__(self, message: str, *, rank: int, child_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback


# ---------------------------------------------------------------------- what the worker is given


class ModelLoadError(WorkerError, ValueError):
    """The model cannot be served: missing, unreadable, or of an unsupported family."""


class ShardingError(ModelLoadError):
    """The model cannot be split over the ranks asked for: a world size that does not divide a
    head count or the MLP width, a rank outside the world, or a process group of another
    shape. Raised before anything is changed."""


class DrafterSpecError(WorkerError, ValueError):
    """A drafter specification that names no drafter, or an out-of-range rate."""


class DeviceUnavailable(WorkerError, ValueError):
    """``--device cuda`` (or ``cuda:N``) where torch sees no such GPU."""


class PromptFileError(WorkerError, ValueError):
    """A prompts file line that is not ``{"id": ..., "token_ids": [...]}`` (or ``"text"``)."""


class Interrupted(WorkerError):
    """Ctrl-C, taken between two steps; carries the figures of the steps run so far."""

    def __init__(self, stats: RunStats) -> None:
        super().__init__("interrupted")
        self.stats = stats


# ---------------------------------------------------------------------- input a kernel refuses


class KvallocAttentionError(WorkerError, ValueError):
    """Input the pool attention cannot serve: no step layout, a step larger than the staging
    buffer, or a feature it does not implement (soft-capping)."""


class PoolAttentionInputError(NworInputError, WorkerError):
    """Tensors the pool attention cannot take: shapes that disagree with the layout or each
    other, a pool dtype the queries cannot use, an fp8 pool without its scales, a window below
    one position. Raised before anything runs; ``field`` names the argument."""


class RotaryError(WorkerError, ValueError):
    """Input the rotary-and-stage kernel does not take."""


class RmsNormError(WorkerError, ValueError):
    """Input the RMSNorm kernel does not take."""


class GatedMlpError(WorkerError, ValueError):
    """Input the SiLU-and-multiply kernel does not take."""
