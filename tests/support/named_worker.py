"""`NamedWorker`: a test's view of a `Client` that names requests by strings.

The protocol names a request by its string id once (admission) and by the handle the reply gives
it afterwards; tests read better with names throughout. This adapter keeps the name <-> handle
map and nothing else: every call goes through the real `Client.step`. A name it never admitted
maps to a handle no request has, so tests can send unknown requests on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepResult

UNKNOWN_HANDLE = (1 << 40) | 1  # generation 2**20, row 1: never handed out in a test


class NamedWorker:
    def __init__(self, client: Client) -> None:
        self.client = client
        self.handles: dict[str, int] = {}

    @property
    def pool(self) -> Any:
        return self.client.pool

    def handle(self, name: str) -> int:
        return self.handles.get(name, UNKNOWN_HANDLE)

    def name(self, handle: int) -> str:
        return next(n for n, h in self.handles.items() if h == handle)

    def names(self, handles: Iterable[int]) -> list[str]:
        return [self.name(h) for h in handles]

    def step(self, *, results: Mapping[str, int] | None = None, reverts: Iterable[str] = (),
             finished: Iterable[str] = (), grants: Mapping[str, int] | None = None,
             padding: Mapping[str, int] | None = None, prefill: Mapping[str, int] | None = None,
             new: Mapping[str, int | tuple[int, int]] | None = None) -> StepResult:
        """Like `Client.step`, with ``name -> number`` mappings; ``new`` maps a name to its
        prompt length, or to (prompt length, first chunk)."""
        kwargs: dict[str, Any] = {"reverts": [self.handle(n) for n in reverts],
                                  "finished": [self.handle(n) for n in finished]}
        for key, mapping in (("results", results), ("grants", grants), ("padding", padding),
                             ("prefill", prefill)):
            if mapping:
                kwargs[key] = ([self.handle(n) for n in mapping], list(mapping.values()))
        names = list(new or {})
        if new:
            prompts = [v if isinstance(v, int) else v[0] for v in new.values()]
            chunks = [0 if isinstance(v, int) else v[1] for v in new.values()]
            kwargs["new"] = (names, prompts, chunks)
        reply = self.client.step(**kwargs)
        for name in finished:
            self.handles.pop(name, None)
        for name, handle in zip(names, reply.admitted.tolist(), strict=True):
            if handle >= 0:
                self.handles[name] = handle
        return reply

    def scheduled(self, reply: StepResult) -> list[tuple[str, int, int, int, int]]:
        """(name, token offset, tokens, drafts, start position) per scheduled request."""
        s = reply.scheduled
        return list(zip(self.names(s.handles.tolist()), s.token_offsets.tolist(),
                        s.num_tokens.tolist(), s.num_drafts.tolist(),
                        s.start_positions.tolist(), strict=True))

    def refused(self, reply: StepResult, call_names: Mapping[str, list[str]]
                ) -> list[tuple[str, str, str]]:
        """(name, kind, reason) per refusal; ``call_names`` lists the names the call sent per
        kind (``{"grant": [...], "prefill": [...], "new": [...]}``)."""
        from kvalloc.server.contract.protocol import REFUSAL_REASONS, REFUSED_KINDS

        r = reply.refused
        return [(call_names[REFUSED_KINDS[k]][i], REFUSED_KINDS[k], REFUSAL_REASONS[why])
                for k, i, why in zip(r.kinds.tolist(), r.indices.tolist(), r.reasons.tolist(),
                                     strict=True)]
