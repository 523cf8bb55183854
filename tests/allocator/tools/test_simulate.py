"""`kvalloc simulate` reproduces both production crashes on purpose and proves `reclaim` clean.

Default run = the production case: one request, 128k prompt ending just before a 256-token
block boundary, 1024 output tokens, MTP3 (D=3), overlap scheduler on its lag-2 timeline (a
step's results come two calls after its grant, so the device runs ahead of the host). At lag 1
results come before the next grant, so no slack is needed: only the row overflow of
``unreclaimed`` is left to find there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from kvalloc.allocator import SlackPolicy
from kvalloc.allocator.commands.simulated_acceptance import Acceptance
from kvalloc.allocator.tools.simulate import (
    DEFAULT_ISL,
    SimulationResult,
    SimulationSpec,
    simulate,
)
from kvalloc.allocator.tools.simulate_prefix import SharingSpec, simulate_sharing
from sigint import interrupt_once_progressing

D = 3
LAGS = [1, 2]
# Capacity above history that `reclaim` holds at most: one grant's 1 + D and its slack D at
# lag 1; at lag 2 two unsettled grants of 1 + D each, no slack.
HELD = {1: 1 + 2 * D, 2: 2 * (1 + D)}


def run(policy: SlackPolicy, **kw) -> SimulationResult:
    return simulate(SimulationSpec(policy=policy, **kw))


def test_the_default_timeline_is_lag_2():
    assert SimulationSpec().lag == 2
    assert run(SlackPolicy.RECLAIM, osl=16).lag == 2


@pytest.mark.parametrize("lag", LAGS)
def test_reclaim_runs_the_production_case_clean_to_the_end(lag):
    r = run(SlackPolicy.RECLAIM, lag=lag)
    assert not r.failed and r.first_reach_past_capacity is None
    assert r.requests_finished == 1 and r.output_tokens >= 1024
    reach, cap = np.array(r.trace["reach"]), np.array(r.trace["capacity"])
    hist = np.array(r.trace["history"])
    assert (reach <= cap).all(), "every forward's write reach is covered by granted capacity"
    assert (cap - hist).max() <= HELD[lag], "no capacity beyond the unsettled grants is held"


def test_at_lag_2_the_device_runs_ahead_of_the_host():
    """Every grant but the first finds the previous step unsettled, and the forward writes from
    the device's position: above history by that step's 1 + accepted."""
    r = run(SlackPolicy.RECLAIM, lag=2)
    assert r.grants_behind == len(r.trace["reach"]) - 1  # one request: all its forwards
    ahead = np.array(r.trace["reach"]) - np.array(r.trace["history"]) - (1 + D)
    assert ahead[0] == 0 and ahead.min() >= 0 and ahead.max() == 1 + D
    assert (ahead[1:] >= 1).all(), "each later forward starts past the verified token"


def test_at_lag_1_the_device_never_runs_ahead():
    r = run(SlackPolicy.RECLAIM, lag=1)
    assert r.grants_behind == 0
    reach, hist = np.array(r.trace["reach"]), np.array(r.trace["history"])
    assert (reach == hist + 1 + D).all(), "each forward starts at the settled history"


def test_no_slack_policy_hits_an_illegal_memory_access_at_a_block_boundary_at_lag_2():
    r = run(SlackPolicy.NONE, lag=2)
    assert r.failed and r.first_ima is not None
    assert r.first_ima.step <= 36
    f = r.first_ima
    assert f.reach > f.allocated_tokens >= f.capacity, "the write lands past the granted blocks"
    assert f.allocated_tokens % 256 == 0 and f.reach - 1 - D < f.allocated_tokens, (
        "the forward starts inside the row's last block and writes across its end")
    assert r.first_row_overflow is None


@pytest.mark.parametrize("seed", range(8))
def test_no_slack_policy_faults_before_the_output_finishes_for_any_seed_at_lag_2(seed):
    r = run(SlackPolicy.NONE, seed=seed, lag=2)
    assert r.first_ima is not None
    assert r.first_ima.step <= r.steps


@pytest.mark.parametrize("seed", range(4))
def test_at_lag_1_results_come_before_the_next_grant_so_no_slack_is_needed(seed):
    """The rule: at lag 1 the host has settled every accepted draft before it grants again, so
    the device writes from history and 1 + D covers it; `none` runs clean."""
    r = run(SlackPolicy.NONE, seed=seed, lag=1)
    assert not r.failed
    assert r.first_reach_past_capacity is None
    assert r.requests_finished == 1


@pytest.mark.parametrize("lag", LAGS)
def test_unreclaimed_slack_leaks_draft_len_per_step_until_the_row_overflows(lag):
    r = run(SlackPolicy.UNRECLAIMED, lag=lag)
    assert r.failed and r.first_row_overflow is not None
    assert r.first_ima is None
    assert r.requests_finished == 0 and r.output_tokens < 1024, "overflow before the output ends"
    cap, hist = np.array(r.trace["capacity"]), np.array(r.trace["history"])
    leak = np.diff(cap - hist)
    # At lag 2 the second grant comes before the first results: 1 + 2D more, nothing settled.
    settled = leak[lag - 1:]
    assert (settled == D).all(), "capacity - history grows by exactly D every settled step"


def test_without_overlap_even_the_no_slack_policy_is_safe():
    """No overlap means no accepted-but-uncommitted lead: 1 + D is enough."""
    r = run(SlackPolicy.NONE, overlap=False, lag=1)
    assert not r.failed


def test_without_overlap_there_is_no_lag_2():
    with pytest.raises(ValueError, match="lag 1"):
        SimulationSpec(overlap=False, lag=2)


@pytest.mark.parametrize("lag", LAGS)
def test_many_requests_share_one_pool_and_all_finish(lag):
    r = run(SlackPolicy.RECLAIM, num_requests=32, isl=3000, osl=300, tokens_per_block=16,
            acceptance=Acceptance("uniform"), seed=3, lag=lag)
    assert not r.failed
    assert r.requests_finished == 32


@pytest.mark.parametrize("lag", LAGS)
def test_tight_pool_refuses_grants_instead_of_overcommitting(lag):
    r = run(SlackPolicy.RECLAIM, num_requests=8, isl=200, osl=100, tokens_per_block=16,
            num_blocks=8 * 14 + 1, lag=lag)
    assert r.grants_refused > 0
    assert not r.failed


def test_cli_writes_json_and_plot_and_exits_nonzero_on_failure(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    proc = subprocess.run(
        [sys.executable, "-m", "kvalloc.server.cli", "simulate", "--policy", "none", "--osl", "64",
         "--json", str(out), "--plot", str(png), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["failed"] is True and summary["first_ima"]["step"] >= 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_prints_the_summary_of_the_steps_run_and_exits_130(tmp_path):
    """SIGINT to a real run mid-loop: the step in progress ends, the summary of the steps so far
    (marked interrupted) goes to stdout and --json, exit 130, no traceback."""
    out = tmp_path / "s.json"
    r = interrupt_once_progressing(
        [sys.executable, "-m", "kvalloc.server.cli", "simulate", "--osl", "20000", "--num-requests",
         "64", "--json", str(out)],
        r"[1-9]\d*/\d+", timeout_s=120)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    summary = json.loads(r.stdout)
    assert summary == json.loads(out.read_text())
    assert summary["interrupted"] is True and summary["steps"] > 0


def stop_after(calls: int):
    """A stop request that comes on its ``calls``-th question, as if Ctrl-C fell there."""
    asked = iter(range(calls, 0, -1))
    return lambda: next(asked, 0) == 1


def test_a_stop_request_ends_either_workload_between_steps_with_invariants_held():
    """The loops ask before each step: asked the 5th time, 4 steps have run; the result stands
    (`finish` and the sharing run check the manager's invariants on the pool as it is)."""
    crash = simulate(SimulationSpec(osl=10_000, num_requests=4), stop=stop_after(5))
    assert crash.steps == 4 and not crash.failed
    shared = simulate_sharing(SharingSpec(conversations=64, turns=4, system_len=64),
                              stop=stop_after(5))
    assert shared.steps == 4 and shared.turns < 64 * 4


def test_cli_exits_zero_for_a_clean_run():
    proc = subprocess.run(
        [sys.executable, "-m", "kvalloc.server.cli", "simulate", "--osl", "64", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["failed"] is False


# README.md's "Reproducing the two crashes", at both lags: exit status and what failed where.
@pytest.mark.parametrize("lag, policy, status, failure, step", [
    (2, "none", 1, "first_ima", 3),
    (2, "unreclaimed", 1, "first_row_overflow", 193),
    (2, "reclaim", 0, None, None),
    (1, "none", 0, None, None),
    (1, "unreclaimed", 1, "first_row_overflow", 193),
    (1, "reclaim", 0, None, None),
])
def test_cli_reproduces_each_policy_outcome_at_each_lag(lag, policy, status, failure, step):
    argv = ["--policy", policy, "--no-progress"] + ([] if lag == 2 else ["--lag", "1"])
    proc = subprocess.run([sys.executable, "-m", "kvalloc.server.cli", "simulate", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["lag"] == lag
    failures = {k for k in ("first_ima", "first_row_overflow") if summary[k] is not None}
    assert failures == ({failure} if failure else set())
    if failure:
        assert summary[failure]["step"] == step


@pytest.mark.parametrize("argv, message", [
    (["--acceptance", "geometric:2"], "--acceptance"),
    (["--isl", "0"], "--isl"),
    (["--draft-len", "-1"], "--draft-len"),
    (["--lag", "3"], "--lag"),
    (["--no-overlap", "--lag", "2"], "--no-overlap --lag 2"),
])
def test_cli_rejects_bad_arguments_naming_them(argv, message):
    proc = subprocess.run([sys.executable, "-m", "kvalloc.server.cli", "simulate", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr


CLEAN = "clean: the write reach stays within granted capacity"


@pytest.mark.parametrize("policy, lag, verdict", [
    (SlackPolicy.NONE, 2, "IMA at step"), (SlackPolicy.UNRECLAIMED, 2, "row overflow at step"),
    (SlackPolicy.RECLAIM, 2, CLEAN), (SlackPolicy.NONE, 1, CLEAN)])
def test_the_plot_names_the_outcome_and_keeps_its_legends_off_the_data(policy, lag, verdict):
    import matplotlib.pyplot as plt
    from kvalloc.allocator.tools.simulate_plot import figure

    result = run(policy, lag=lag)
    fig = figure(result)
    try:
        assert f"--lag {lag}: {verdict}" in fig._suptitle.get_text()
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


# The seed's model class: a windowed cache (DeepSeek-V4's MLA latent with a sliding window),
# MTP3, the overlap scheduler at lag 2, a prompt 8 tokens short of a 256-token block boundary.
W = 4096


def test_a_window_reproduces_the_ima_at_its_first_block_crossing_under_no_slack():
    r = run(SlackPolicy.NONE, window=W)
    assert r.first_ima is not None and r.first_window_crossing is not None
    # The append that faults lands on the entry past the row's last block, within a step of
    # the window's first block crossing after prefill.
    assert r.first_ima.reach > r.first_ima.allocated_tokens
    assert abs(r.first_ima.step - r.first_window_crossing) <= 1
    assert r.first_ima.allocated_tokens == -(-(DEFAULT_ISL + 1) // 256) * 256


def test_a_window_overflows_its_row_under_unreclaimed_slack():
    r = run(SlackPolicy.UNRECLAIMED, window=W)
    assert r.first_row_overflow is not None and r.first_ima is None


@pytest.mark.parametrize("lag", LAGS)
def test_a_window_runs_clean_under_reclaim_holding_its_window_and_no_more(lag):
    r = run(SlackPolicy.RECLAIM, window=W, lag=lag)
    assert not r.failed and r.requests_finished == 1
    full = run(SlackPolicy.RECLAIM, lag=lag, osl=16)
    assert r.max_decode_blocks <= -(-(W + 3 * (1 + D) + 256 - 2) // 256) == 18
    assert full.max_decode_blocks == 0 and full.window is None


def test_a_window_given_back_too_early_is_an_ima_on_the_read_side():
    """The simulator's read check: a forward whose window reaches a released column faults,
    as a kernel reading from the window's first block would."""
    from kvalloc.allocator.tools.simulate import Timeline

    timeline = Timeline(SimulationSpec(window=64, isl=1000, osl=8, tokens_per_block=16))
    timeline.call(1)
    timeline.call(2)
    row = int(timeline.rows[0])
    timeline.manager.table.host[row, (1000 - 64) // 16] = -2  # a window block, wrongly gone
    timeline._check_writes(3)
    assert timeline.result.first_ima is not None
