"""The accounting rules (`allocator.capacity.accounting`) for one row at a time, compiled for the
step: blocks for a capacity, the slack of a grant, what a settle releases, the tokens a new
request is admitted with.

Invariants: each gives for one row what `reference` gives for a row of its arrays; where
`accounting`'s rule is already one row's, it is that rule, compiled.
"""
from __future__ import annotations

from kvalloc.allocator.capacity import accounting
from kvalloc.allocator.capacity.step.compiled.inlining import inlined

blocks_for = inlined(accounting.blocks_for)
slack_for = inlined(accounting.slack_rule)
lag2_slack = inlined(accounting.lag2_slack)
released_behind = inlined(accounting.released_behind)
revert = inlined(accounting.revert)
settle_behind = inlined(accounting.settle_behind)


@inlined
def grant_slack(draft: int, at_lag2: bool, lead: int, overlap: bool, policy: int) -> int:
    """`reference.grant_slack` for one grant."""
    if at_lag2:
        return lag2_slack(draft, policy)
    return slack_for(draft, lead, overlap, policy)


@inlined
def admitted_tokens(prompt_len: int, first_chunk: int, cached_tokens: int) -> int:
    """`reference.admitted_tokens` for one request."""
    rest = prompt_len - cached_tokens
    return cached_tokens + (rest if first_chunk == 0 else min(first_chunk, rest))
