"""The capacity-accounting rules of docs/design.md as pure, vectorised functions.

Every grant site and every settlement in `KVCacheManager` goes through these, for one request or
for a whole batch (numpy arrays), so the per-request methods and the batched ``step`` cannot drift.

Terms (tokens, per request): ``capacity`` reserved, ``history`` committed (history <= capacity),
``draft`` the D of the pending grant, ``slack`` the overlap slack that grant recorded.
"""

from __future__ import annotations

import numpy as np

from allocator.capacity.state import POLICY_CODES
from allocator.config import SlackPolicy

_NO_SLACK = POLICY_CODES[SlackPolicy.NONE]


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
