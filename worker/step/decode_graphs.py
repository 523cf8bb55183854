"""`DecodeGraphs`: decode steps replayed as CUDA graphs, one per step shape.

A decode step's device work (the model's forward over the pool, greedy verification, an overlap
worker's commit) launches hundreds of kernels; from Python that takes longer than the GPU needs
to run them at small batches, so the GPU would wait for the host. Captured once per shape
(entries x tokens per entry: every decode padded to the same draft count through the protocol's
padding grant, the batch grown to its bucket by `DeviceStep`, `worker.step.batch_buckets`), the
step replays in one launch.

The graph reads one static input: the step's columns as uploaded (`DeviceStep`), where a
replayed step's upload lands directly. Everything else a step needs is device work inside
the graph: its metadata (positions, each group's slots, input ids: `worker.step.step_metadata`),
a device drafter's drafts, the table checks of ``--validate``, the forward, verification and an
overlap worker's commit; each group's layout reads the static columns through the group's own
block table (the service's, which it updates in place). A replay therefore costs the host one
upload and one launch, whatever the model. Its outputs (the metadata among them) are the
graph's static tensors, which the next replay of the shape overwrites. The first step of a
shape runs eagerly (it also warms every kernel up for the shape) and the graph is captured
right after, for the next one; nothing of the capture itself runs. Graphs share one memory
pool; the least recently used beyond ``max_graphs`` is dropped.

A replay runs what the capture recorded, host values and all: whatever the body read from the
host at capture (the plan's sizes, the kernels' launch choices) holds for every step replayed.
`capture_cuda_graph` is the capture. A `Capture` whose replay simply calls the body again (the
tests' on CPU) keeps the capture's plan and static inputs too, so a body that reads something
of the plan that differs between two steps of one shape gives wrong tokens there as well.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from kvalloc.allocator.common.device_io import capturing

# A decode-only step's shape: (entries it runs, tokens each).
Shape = tuple[int, int]

# ``capture(body)`` -> ``replay``: each ``replay()`` does ``body``'s work again and returns its
# outputs; capturing does none of it.
Capture = Callable[[Callable[[], Any]], Callable[[], Any]]


# transformers' default experts forward for mixture-of-experts models (``grouped_mm``) may read
# its routing offsets back to the host, which a capture forbids; ``batched_mm`` gathers each
# token's expert weights with static shapes and no host read. It gathers those weights per
# (token, expert) pair, which suits the small models the reference worker proves itself with,
# not a full-size MoE.
GRAPH_SAFE_EXPERTS = "batched_mm"


def make_capturable(model: Any) -> None:
    """Select the forward a captured step can replay for ``model``'s mixture-of-experts layers
    (a model without experts is left as it is)."""
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation(GRAPH_SAFE_EXPERTS)


def capture_cuda_graph() -> Capture:
    """Captures into CUDA graphs that share one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(body: Callable[[], Any]) -> Callable[[], Any]:
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool):
            outputs = body()

        def replay() -> Any:
            graph.replay()
            return outputs

        return replay

    return capture


class _Bucket(NamedTuple):
    replay: Callable[[], Any]
    columns: torch.Tensor  # the static copy of the step's columns the replay reads


class DecodeGraphs:
    def __init__(self, max_graphs: int = 32, *, capture: Capture | None = None) -> None:
        """``capture``: `capture_cuda_graph()` by default."""
        self.max_graphs = max_graphs
        self._capture_body = capture or capture_cuda_graph()
        self._buckets: OrderedDict[Shape, _Bucket] = OrderedDict()
        self._replays: dict[Shape, int] = {}
        self.captured = 0

    def make_room(self, graphs: int) -> None:
        """Hold at least ``graphs`` graphs before dropping any."""
        self.max_graphs = max(self.max_graphs, graphs)

    def captured_for(self, shape: Shape) -> bool:
        """Whether a decode-only step of ``shape`` (entries run, tokens each) has its graph."""
        return shape in self._buckets

    @property
    def replayed(self) -> int:
        """Replays so far, of every shape."""
        return sum(self._replays.values())

    @property
    def most_replayed(self) -> Callable[[], Any] | None:
        """The replay of the shape replayed most often, the steady state a profiler should see
        (the last one captured is often a batch's tail, a request or two)."""
        live = [key for key in self._replays if key in self._buckets]
        return self._buckets[max(live, key=self._replays.__getitem__)].replay if live else None

    def static_columns(self, shape: Shape) -> torch.Tensor | None:
        """The static columns the replay of ``shape`` reads, once it is captured (None
        before): the step's upload lands there, then `replay`."""
        bucket = self._buckets.get(shape)
        return bucket.columns if bucket is not None else None

    def replay(self, shape: Shape) -> Any:
        """Replay ``shape``'s graph over what its static columns hold now."""
        self._buckets.move_to_end(shape)
        self._replays[shape] = self._replays.get(shape, 0) + 1
        return self._buckets[shape].replay()

    def run_and_capture(self, shape: Shape, plan: Any, cols: Any,
                        body: Callable[[Any, Any], Any]) -> Any:
        """``body(plan, cols)`` run now for a decode-only ``plan`` of ``shape``, which has no
        graph yet (``cols``: its uploaded columns, views of ``cols.flat`` that
        ``cols.over(flat)`` rebuilds over another copy), then captured over a static copy for
        the next step of the shape."""
        outputs = body(plan, cols)
        flat = cols.flat.clone()
        static_cols = cols.over(flat)
        self._buckets[shape] = _Bucket(self._capture_body(lambda: body(plan, static_cols)),
                                       flat)
        self.captured += 1
        if len(self._buckets) > self.max_graphs:
            self._buckets.popitem(last=False)
        return outputs
