"""What one run of `kvalloc simulate` found: its figures, its first failures and request 0's trace.

The model (`simulate`) fills it in and the picture (`simulate_plot`) draws it, so it lives apart
from both: the picture reads a result without importing the model that makes one.

Invariants: ``failed`` is True exactly when an IMA or a row overflow was found; ``summary`` is
every field but the trace (too long for a report), plus ``failed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Failure:
    step: int
    request: int
    reach: int
    capacity: int
    allocated_tokens: int
    history: int


@dataclass
class SimulationResult:
    policy: str
    lag: int
    steps: int
    requests_finished: int
    requests_total: int
    output_tokens: int
    grants_refused: int
    grants_behind: int  # grants that found the request's previous step unsettled (lag 2)
    max_capacity_minus_history: int
    first_ima: Failure | None = None
    first_reach_past_capacity: Failure | None = None
    first_row_overflow: Failure | None = None
    max_blocks_per_seq: int = 0
    tokens_per_block: int = 0
    # A windowed group (`--window`): its window, the first call that launched a forward whose
    # window starts a block later than the one before (crossed a block boundary), and the most
    # blocks a request held once its window gave blocks back.
    window: int | None = None
    first_window_crossing: int | None = None
    max_decode_blocks: int = 0
    trace: dict[str, list[int]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.first_ima is not None or self.first_row_overflow is not None

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("trace")
        out["failed"] = self.failed
        return out
