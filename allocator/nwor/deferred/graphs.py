"""`CommitGraphs`: the CUDA graphs a manager replays instead of launching a commit's work.

- commit graphs (``GraphCapture.capture_commit``): the device commit (keep mask, fused write, device
  counters) of a window of up to ``rows`` tokens whose counts are a device tensor;
- verify graphs (``GraphCapture.capture_verify``): acceptance over one padded shape
  (`StaticAcceptance`) and the same commit, for ``verify_and_commit``;
- host-write graphs (`HostWriteGraphs`): the commit of a window staged with host slots, per
  staging buffer and row bucket, on CUDA with the Triton write only. They and their pinned
  buffer are made when first needed (by such a commit, or by ``capture_host_writes``):
  a library that stages layer by layer never pays for them.

A window replays the smallest graph of its kind that covers it. Commit and verify graphs replay
reads of the manager's own staging buffer: a window staged from the caller's buffer replays
none of them.

Invariants: a commit graph holds no acceptance and a verify graph holds one; every graph covers
1 to max_tokens rows, a verify graph at most max_requests requests; host-write graphs exist
only on CUDA with the Triton write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvalloc.allocator.common.device_io import capture_graph
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.allocator.nwor.acceptance import StaticAcceptance
from kvalloc.allocator.nwor.commit_kernel import Backend
from kvalloc.allocator.nwor.host_write_graphs import HostWriteGraphs


@dataclass
class CapturedCommit:
    rows: int
    graph: torch.cuda.CUDAGraph
    acceptance: StaticAcceptance | None = None


class CommitGraphs:
    def __init__(self, max_tokens: int, device: torch.device, backend: Backend) -> None:
        self.max_tokens = max_tokens
        self.device = device
        self.backend = backend
        self.commit: list[CapturedCommit] = []
        self.verify: list[CapturedCommit] = []
        self.host: HostWriteGraphs | None = None

    def capture_commit(self, rows: int, run: Callable[[], None],
                       warm_up: Callable[[], None]) -> None:
        """Capture ``run``, the device commit of ``rows`` rows; ``warm_up`` runs its kernels
        first, writing and counting nothing."""
        self.commit.append(CapturedCommit(rows, capture_graph(run, warmup=warm_up)))

    def capture_verify(self, rows: int, acceptance: StaticAcceptance, counts: torch.Tensor,
                       run: Callable[[], None], warm_up: Callable[[], None]) -> None:
        """`capture_commit`, after ``acceptance`` computes the accepted ``counts`` it commits."""

        def body() -> None:
            acceptance.compute_counts(counts)
            run()

        def warmup() -> None:
            acceptance.compute_counts(counts)
            warm_up()

        self.verify.append(CapturedCommit(rows, capture_graph(body, warmup=warmup), acceptance))

    def commit_graph(self, total: int) -> CapturedCommit | None:
        """The smallest commit graph that covers a window of ``total`` tokens."""
        return min((g for g in self.commit if g.rows >= total), key=lambda g: g.rows,
                   default=None)

    def verify_graph(self, total: int, draft_ids: torch.Tensor,
                     sampled_ids: torch.Tensor) -> CapturedCommit | None:
        """The smallest verify graph that covers a window of ``total`` tokens and whose
        acceptance fits these drafts and samples."""
        fits = [g for g in self.verify if g.rows >= total and g.acceptance is not None
                and g.acceptance.fits(draft_ids, sampled_ids)]
        return min(fits, key=lambda g: g.rows, default=None)

    def host_writes(self) -> HostWriteGraphs | None:
        """The host-write graphs (made now, if they can exist), or None: a host-slot commit
        then writes eagerly."""
        if self.host is None and self.device.type == "cuda" and self.backend == "triton":
            self.host = HostWriteGraphs(self.max_tokens, self.device)
        return self.host

    def drop_host_writes(self, source: torch.Tensor) -> int:
        """Forget the host-write graphs that read ``source``; how many went."""
        return 0 if self.host is None else self.host.drop(source)

    def check_invariants(self, max_requests: int) -> None:
        if any(g.acceptance is not None for g in self.commit) or any(
                g.acceptance is None or g.acceptance.batch > max_requests for g in self.verify):
            raise InvariantViolation("graphs: a commit graph with acceptance, or a verify graph "
                                     "without (or over max_requests)")
        if any(not 1 <= g.rows <= self.max_tokens for g in self.commit + self.verify):
            raise InvariantViolation("graphs: a graph covers rows outside [1, max_tokens]")
        if self.host is not None and (self.device.type != "cuda" or self.backend != "triton"):
            raise InvariantViolation("graphs: host-write graphs without CUDA and Triton")
