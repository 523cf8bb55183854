"""The picture ``kvalloc simulate --plot`` draws for request 0, one point per scheduler step.

Top: everything measured from the request's committed history, so the few tokens that decide
an IMA are not lost in a 128k-token axis. The granted capacity is a shaded band, the write reach
(the device's own position + 1 + D: at lag 2 above history by the forward the host has not heard
of yet) a line on top of it (a red cross wherever it leaves the band), and the end of the
allocated blocks a dashed line that dips into view at every block boundary: reach past that line
is the illegal memory access. Bottom: the request's block-table row filling up against its limit,
which is where the row overflow shows. A failure is a vertical line through both panels with a
label at the top of the picture; the legend sits outside the axes so it hides nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvalloc.allocator.tools.simulate_result import Failure, SimulationResult
    from matplotlib.figure import Figure

CAPACITY, REACH, ALLOCATED, HISTORY, LIMIT = "#4C72B0", "#DD8452", "#55A868", "#333333", "#8C8C8C"
FAILURE_COLOR = {"IMA": "#C44E52", "row overflow": "#8172B3"}


def plot(result: SimulationResult, path: Path) -> None:
    """Write the PNG of ``result``'s trace to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(result: SimulationResult) -> Figure:
    """The picture of ``result``'s trace (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = {k: np.asarray(v, dtype=np.int64) for k, v in result.trace.items()}
    steps = np.arange(1, len(t["history"]) + 1)
    history = t["history"]
    capacity, reach = t["capacity"] - history, t["reach"] - history
    allocated = t["allocated"] - history
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})

    top.fill_between(steps, 0, capacity, color=CAPACITY, alpha=0.25, linewidth=0)
    top.plot(steps, capacity, color=CAPACITY, linewidth=1.2,
             label="granted capacity (shaded)")
    top.plot(steps, reach, color=REACH, linewidth=1.4, marker=".", markersize=3,
             label="write reach: last position the forward writes")
    top.plot(steps, allocated, color=ALLOCATED, linestyle="--", linewidth=1.2,
             label="end of the allocated blocks\n(past it the block table holds -1)")
    top.axhline(0, color=HISTORY, linewidth=1, label="committed history")
    over = reach > capacity
    if over.any():
        top.scatter(steps[over], reach[over], color=FAILURE_COLOR["IMA"], marker="x", s=22,
                    zorder=3, label="reach past capacity")
    tallest = max(int(capacity.max(initial=0)), int(reach.max(initial=0)), 1)
    top.set_ylim(-0.1 * tallest - 1, 1.8 * tallest + 2)  # allocated - history is mostly far above
    top.set_ylabel("tokens above committed history")

    tpb = result.tokens_per_block
    bottom.plot(steps, t["allocated"] // tpb, color=ALLOCATED, linewidth=1.4,
                label="blocks in the request's row")
    bottom.axhline(result.max_blocks_per_seq, color=LIMIT, linestyle=":", linewidth=1.4,
                   label=f"row limit: max_blocks_per_seq = {result.max_blocks_per_seq}")
    bottom.set_ylabel(f"blocks ({tpb} tokens each)")
    bottom.set_xlabel("scheduler step")

    failures = [(name, f) for name, f in (("IMA", result.first_ima),
                                          ("row overflow", result.first_row_overflow)) if f]
    for name, failure in failures:
        _mark(top, bottom, name, failure, steps.size)
    verdict = ", ".join(f"{name} at step {f.step}" for name, f in failures) or (
        "clean: the write reach stays within granted capacity at every step")
    fig.suptitle(f"kvalloc simulate --policy {result.policy} --lag {result.lag}: {verdict}",
                 fontsize=12)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _mark(top: Any, bottom: Any, name: str, failure: Failure, num_steps: int) -> None:
    """A vertical line through both panels at the failure, with what happened written beside it
    at the top of the upper panel, on whichever side has room."""
    color = FAILURE_COLOR[name]
    for ax in (top, bottom):
        ax.axvline(failure.step, color=color, linewidth=1.6)
    if name == "IMA":
        detail = f"reach {failure.reach} > allocated {failure.allocated_tokens} tokens"
    else:
        detail = f"capacity {failure.capacity} tokens needs more blocks than the row holds"
    right = failure.step < 0.6 * max(num_steps, 1)
    label = {"color": color, "fontsize": 9, "fontweight": "bold",
             "bbox": {"boxstyle": "round", "facecolor": "white", "edgecolor": color}}
    if name == "IMA":  # ring the write that faults, and point at it from the label
        point = (failure.step, failure.reach - failure.history)
        top.scatter(*point, s=160, facecolors="none", edgecolors=color, linewidths=2, zorder=4)
        top.annotate(f"{name} at step {failure.step}\n{detail}", xy=point,
                     xytext=(0.06 if right else 0.94, 0.93), textcoords="axes fraction",
                     ha="left" if right else "right", va="top",
                     arrowprops={"arrowstyle": "->", "color": color, "linewidth": 1.4}, **label)
    else:
        top.annotate(f"{name} at step {failure.step}\n{detail}", xy=(failure.step, 0.93),
                     xycoords=("data", "axes fraction"), xytext=(8 if right else -8, 0),
                     textcoords="offset points", ha="left" if right else "right", va="top",
                     **label)
