"""`RunStats`: what a worker's run did (steps, tokens, drafts, preemptions, what its own commit
wrote) and where its time went (the service calls, launching forwards, the device busy and
idle), and `DeviceClock`, which times the device from the events each launched step records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from kvalloc.worker.step.device_step import Launched


@dataclass
class RunStats:
    """What a run did and how long its parts took (a worker's figures: the CLI prints them,
    benchmarks record them)."""

    steps: int = 0
    wall_s: float = 0.0
    call_s: float = 0.0  # inside the service call
    forward_s: float = 0.0  # launching each step's device work (on a CPU: running it)
    metadata_s: float = 0.0  # of which laying out the step's inputs, positions and slots
    generated_tokens: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    preemptions: int = 0
    refused_new: int = 0
    # Prompt tokens found in the service's cached prefix blocks: prefill the forward skipped.
    cached_prompt_tokens: int = 0
    # Steps that only decode (no prefill chunk, no new prompt): the steady state of serving.
    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_call_s: float = 0.0
    # Forwards launched before the host had read the previous step's outcome: the device ran
    # ahead of the host (overlap only).
    forwards_ahead: int = 0
    # CUDA only, from events on the worker's stream: time between one forward's end and the
    # next one's start, and inside forwards (inputs, forward, verification, commit).
    device_idle_s: float = 0.0
    device_busy_s: float = 0.0
    decode_busy_s: float = 0.0  # of which in decode-only steps (every entry a decode)
    decode_idle_s: float = 0.0  # idle before a decode-only step: the steady state's gaps
    # Block-table entries a step addressed that held no block (the validator, when on).
    table_violations: int = 0
    # An overlap worker's own commit: tokens it wrote, and kept tokens it refused because their
    # block was a protected (cached) prefix block.
    committed_tokens: int = 0
    refused_tokens: int = 0
    # Decode steps replayed as CUDA graphs, and the graphs captured for them (cuda_graphs).
    graph_replays: int = 0
    graphs_captured: int = 0
    # Entries decode steps ran past the planned ones, to reach their batch bucket (pad_decodes).
    padded_entries: int = 0
    # Before serving (`Engine.warm_up`): the shapes run, and how long that took.
    warm_up_shapes: int = 0
    warm_up_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def call_share(self) -> float:
        """The share of step wall time spent in the service call."""
        return self.call_s / self.wall_s if self.wall_s else 0.0

    @property
    def decode_call_share(self) -> float:
        """The call's share of the wall time of decode-only steps."""
        return self.decode_call_s / self.decode_wall_s if self.decode_wall_s else 0.0

    def count_step(self, wall_s: float, call_s: float, *, decode_only: bool) -> None:
        """One step of the loop: its wall time and the service call's share of it."""
        self.steps += 1
        self.wall_s += wall_s
        self.call_s += call_s
        if decode_only:
            self.decode_steps += 1
            self.decode_wall_s += wall_s
            self.decode_call_s += call_s

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s,
                "acceptance_rate": self.acceptance_rate, "call_share": self.call_share,
                "decode_call_share": self.decode_call_share}


class DeviceClock:
    """Adds each read step's device time to ``stats``: busy between its events (CUDA only), and
    idle since the previous step's end."""

    def __init__(self, stats: RunStats) -> None:
        self.stats = stats
        self._last_done: torch.cuda.Event | None = None

    def add(self, launched: Launched) -> None:
        """``launched``'s device time, once its outcome has been read."""
        if launched.started is None or launched.done is None:
            return
        idle = (self._last_done.elapsed_time(launched.started) / 1e3
                if self._last_done is not None else 0.0)
        busy = launched.started.elapsed_time(launched.done) / 1e3
        self.stats.device_idle_s += idle
        self.stats.device_busy_s += busy
        if launched.plan.all_decodes:
            self.stats.decode_idle_s += idle
            self.stats.decode_busy_s += busy
        self._last_done = launched.done
