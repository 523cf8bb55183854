"""`kvalloc simulate` reproduces both production crashes on purpose and proves `reclaim` clean.

Default run = the production case: one request, 128k prompt ending just before a 256-token
block boundary, 1024 output tokens, MTP3 (D=3), overlap scheduler.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from allocator import SlackPolicy
from allocator.tools.simulate import Acceptance, SimulationSpec, simulate

D = 3


def run(policy: SlackPolicy, **kw) -> object:
    return simulate(SimulationSpec(policy=policy, **kw))


def test_reclaim_runs_the_production_case_clean_to_the_end():
    r = run(SlackPolicy.RECLAIM)
    assert not r.failed
    assert r.requests_finished == 1 and r.output_tokens >= 1024
    reach, cap = np.array(r.trace["reach"]), np.array(r.trace["capacity"])
    hist = np.array(r.trace["history"])
    assert (reach <= cap).all(), "every forward's write reach is covered by granted capacity"
    assert (cap - hist).max() <= 1 + 2 * D, "no capacity beyond one step's grant is held"


def test_no_slack_policy_hits_an_illegal_memory_access_within_a_few_dozen_steps():
    r = run(SlackPolicy.NONE)
    assert r.failed and r.first_ima is not None
    assert r.first_ima.step <= 36
    f = r.first_ima
    assert f.reach > f.allocated_tokens >= f.capacity, "the write lands past the granted blocks"
    assert r.first_row_overflow is None


@pytest.mark.parametrize("seed", range(8))
def test_no_slack_policy_faults_before_the_output_finishes_for_any_seed(seed):
    r = run(SlackPolicy.NONE, seed=seed)
    assert r.first_ima is not None
    assert r.first_ima.step <= r.steps


def test_unreclaimed_slack_leaks_draft_len_per_step_until_the_row_overflows():
    r = run(SlackPolicy.UNRECLAIMED)
    assert r.failed and r.first_row_overflow is not None
    assert r.first_ima is None
    assert r.requests_finished == 0 and r.output_tokens < 1024, "overflow before the output ends"
    cap, hist = np.array(r.trace["capacity"]), np.array(r.trace["history"])
    leak = np.diff(cap - hist)
    assert (leak == D).all(), "capacity - history grows by exactly D every step"


def test_without_overlap_even_the_no_slack_policy_is_safe():
    """No overlap means no accepted-but-uncommitted lead: 1 + D is enough."""
    r = run(SlackPolicy.NONE, overlap=False)
    assert not r.failed


def test_many_requests_share_one_pool_and_all_finish():
    r = run(SlackPolicy.RECLAIM, num_requests=32, isl=3000, osl=300, tokens_per_block=16,
            acceptance=Acceptance("uniform"), seed=3)
    assert not r.failed
    assert r.requests_finished == 32


def test_tight_pool_refuses_grants_instead_of_overcommitting():
    r = run(SlackPolicy.RECLAIM, num_requests=8, isl=200, osl=100, tokens_per_block=16,
            num_blocks=8 * 14 + 1)
    assert r.grants_refused > 0
    assert not r.failed


def test_cli_writes_json_and_plot_and_exits_nonzero_on_failure(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "simulate", "--policy", "none", "--osl", "64",
         "--json", str(out), "--plot", str(png), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["failed"] is True and summary["first_ima"]["step"] >= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_exits_zero_for_a_clean_run():
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "simulate", "--osl", "64", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["failed"] is False


@pytest.mark.parametrize("argv, message", [
    (["--acceptance", "geometric:2"], "--acceptance"),
    (["--isl", "0"], "--isl"),
    (["--draft-len", "-1"], "--draft-len"),
])
def test_cli_rejects_bad_arguments_naming_them(argv, message):
    proc = subprocess.run([sys.executable, "-m", "server.cli", "simulate", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("policy, verdict", [
    (SlackPolicy.NONE, "IMA at step"), (SlackPolicy.UNRECLAIMED, "row overflow at step"),
    (SlackPolicy.RECLAIM, "clean: the write reach stays within granted capacity")])
def test_the_plot_names_the_outcome_and_keeps_its_legends_off_the_data(policy, verdict):
    import matplotlib.pyplot as plt

    from allocator.tools.simulate_plot import figure

    result = run(policy)
    fig = figure(result)
    try:
        assert verdict in fig._suptitle.get_text()
        top, bottom = fig.axes
        failure = result.first_ima or result.first_row_overflow
        if failure is not None:  # labelled on the picture, at the step it happened
            label = next(t for t in top.texts if t.get_text().startswith(verdict))
            assert f"step {failure.step}\n" in label.get_text() + "\n"
            assert any(line.get_xdata()[0] == failure.step for line in bottom.lines[2:])
        fig.canvas.draw()
        for ax in (top, bottom):
            legend = ax.get_legend().get_window_extent()
            assert legend.x0 >= ax.get_window_extent().x1, "the legend covers no data"
        labels = {line.get_label() for line in top.lines}
        assert {"granted capacity (shaded)", "write reach: last position the forward writes",
                "committed history"} <= labels
        assert top.get_ylabel() == "tokens above committed history"
        assert bottom.get_xlabel() == "scheduler step"
    finally:
        plt.close(fig)
