"""The capacity-accounting rules of docs/design.md as pure, vectorised functions.

Every grant site and every settlement in `KVCacheManager` goes through these, for one request or
for a whole batch (numpy arrays), so the per-request methods and the batched ``step`` cannot drift.

Terms (tokens, per request): ``capacity`` reserved, ``history`` committed (history <= capacity),
``draft`` the D of the pending grant, ``slack`` the overlap slack that grant recorded.

Two timelines (docs/design.md, "Lag"). At lag 1 a step's results come with the next call, before
its next grant: the rules above. At lag 2 they come one call later, so a grant may find the
request's previous step still unsettled (*behind*): the device is then already somewhere in that
step's 1 + D tokens, and the grant must cover its own 1 + D past all of them. The behind step's
reservation is that cover, kept whole until its results arrive: a lag-2 grant adds no slack of
its own (`lag2_slack`), and settling the behind step gives back exactly its rejected drafts.
"""

from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.state import POLICY_CODES
from kvalloc.allocator.config import SlackPolicy

_NO_SLACK = POLICY_CODES[SlackPolicy.NONE]
_UNRECLAIMED = POLICY_CODES[SlackPolicy.UNRECLAIMED]


def slack_rule(draft_len, lead, overlap, policy):  # type: ignore[no-untyped-def]
    """Slack a grant records under overlap (unless the policy is ``none``): D, or the device's
    lead if that is larger. ``policy`` is the `POLICY_CODES` integer; numpy arrays and, compiled
    inside the step, plain integers alike (one rule for both steps).

    The lead is the previous step's accepted drafts, which the device has already advanced over
    when this step writes (docs/design.md's accepted-but-uncommitted tokens). With a constant D it
    never exceeds D, so the slack is the design's D; an engine that shortens D from one step to
    the next (dynamic speculation) would otherwise see reach = history + lead + 1 + D outrun
    capacity = history + 1 + 2D: the IMA again.
    """
    if overlap and policy != _NO_SLACK:
        return np.maximum(draft_len, lead)
    return draft_len * 0  # zero in the shape of draft_len, an array or an integer


def lag2_slack(draft_len, policy):  # type: ignore[no-untyped-def]
    """Slack a lag-2 grant records: none, since the behind step's drafts stay reserved until its
    results come; ``unreclaimed`` (the leak, on purpose) still grants D every step. Arrays and
    integers alike, like `slack_rule`."""
    if policy == _UNRECLAIMED:
        return draft_len
    return draft_len * 0


def released_behind(behind_draft, policy):  # type: ignore[no-untyped-def]
    """Drafts of the behind step a lag-2 grant gives back at once: all of them under ``none``
    (the host assumes the unsettled drafts were rejected, and the device, which accepted some,
    writes past capacity: the IMA on purpose), else none. A revert of that grant leaves them
    given back (`revert`)."""
    if policy == _NO_SLACK:
        return behind_draft
    return behind_draft * 0


def revert(capacity, history, draft_len, slack):  # type: ignore[no-untyped-def]
    """``revert_allocate_generation``: the pending grant's ``1 + D + slack`` taken back; what
    `released_behind` gave back of a step behind it stays given back, so a revert never needs a
    block. Capacity never drops below history: under ``none`` at lag 2 results can find fewer
    tokens reserved than the device kept (`settle_behind` raises capacity to the new history,
    eating into the pending grant's reservation). Arrays and integers alike, like `slack_rule`."""
    return np.maximum(capacity - (1 + draft_len + slack), history)


def settle_behind(capacity, history, behind_draft, behind_slack, accepted,  # type: ignore[no-untyped-def]
                  policy):
    """Results for a step that was behind a lag-2 grant: commit 1 + accepted, give back the
    rejected drafts (unless `released_behind` already gave back all of them) and, under
    ``reclaim``, the slack its own grant recorded (none at lag 2; a lag-1 grant's otherwise).
    Capacity never drops below the new history. Returns ``(capacity, history)``."""
    new_history = history + 1 + accepted
    rejected = (behind_draft - accepted) if policy != _NO_SLACK else accepted * 0
    reclaimed = behind_slack if policy != _UNRECLAIMED and policy != _NO_SLACK else 0 * accepted
    return np.maximum(capacity - rejected - reclaimed, new_history), new_history


def slack_for(draft_len: np.ndarray, overlap: bool, policy: SlackPolicy,
              lead: np.ndarray | int = 0) -> np.ndarray:
    """`slack_rule` over arrays, for a `SlackPolicy`."""
    return slack_rule(draft_len, lead, overlap, POLICY_CODES[policy])


def grant_tokens(draft_len: np.ndarray, overlap: bool, policy: SlackPolicy,
                 lead: np.ndarray | int = 0) -> np.ndarray:
    """Capacity a generation grant adds: the step's 1 + D tokens plus its slack."""
    return 1 + draft_len + slack_for(draft_len, overlap, policy, lead)


def settle(capacity: np.ndarray, history: np.ndarray, draft: np.ndarray, slack: np.ndarray,
           accepted: np.ndarray, policy: SlackPolicy) -> tuple[np.ndarray, np.ndarray]:
    """``update_resources``: rewind the D - accepted rejected drafts, reclaim the slack
    (``reclaim`` only), commit 1 + accepted tokens; capacity never drops below the new history.

    Returns ``(capacity, history)``. Net growth per step under ``reclaim`` is 1 + accepted.
    """
    new_history = history + 1 + accepted
    reclaimed = slack if policy is SlackPolicy.RECLAIM else 0
    new_capacity = np.maximum(capacity - (draft - accepted) - reclaimed, new_history)
    return new_capacity, new_history


def blocks_for(capacity: np.ndarray, tokens_per_block: int) -> np.ndarray:
    """ceil(capacity / tokens_per_block)."""
    return -(-capacity // tokens_per_block)
