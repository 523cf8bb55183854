"""The capacity-accounting rules of DESIGN.md as pure, vectorised functions.

Every grant site and every settlement in `KVCacheManager` goes through these, for one request or
for a whole batch (numpy arrays), so the per-request methods and the batched ``step`` cannot drift.

Terms (tokens, per request): ``capacity`` reserved, ``history`` committed (history <= capacity),
``draft`` the D of the pending grant, ``slack`` the overlap slack that grant recorded.
"""

from __future__ import annotations

import numpy as np

from .config import SlackPolicy


def slack_for(draft_len: np.ndarray, overlap: bool, policy: SlackPolicy) -> np.ndarray:
    """Slack a grant of ``draft_len`` records: D under overlap (unless policy is ``none``)."""
    if overlap and policy is not SlackPolicy.NONE:
        return draft_len
    return np.zeros_like(draft_len)


def grant_tokens(draft_len: np.ndarray, overlap: bool, policy: SlackPolicy) -> np.ndarray:
    """Capacity a generation grant adds: the step's 1 + D tokens plus its slack."""
    return 1 + draft_len + slack_for(draft_len, overlap, policy)


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
