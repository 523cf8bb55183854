"""A request as the worker's loop sees it: `NamedPrompt` (what the engine is asked to generate
from), `Request` (one prompt's progress: the engine's only per-request object), `new_request`
(a prompt checked against the model's vocabulary and the pool's longest sequence) and the int64
columns of requests a service call carries."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kvalloc.worker.errors import EngineError


@dataclass(frozen=True)
class NamedPrompt:
    """A request's id and its prompt's token ids: what the engine is asked to generate from."""

    req_id: str
    token_ids: Sequence[int]


@dataclass
class Request:
    """One prompt's progress; the engine's only per-request object."""

    req_id: str
    prompt: np.ndarray
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    handle: int = -1  # the service's handle while admitted
    admitted: np.ndarray | None = None  # the prompt it was (re)admitted with
    scheduled: int = 0  # tokens of `admitted` scheduled so far
    drafts: np.ndarray | None = None  # host drafts of the step being planned (decodes)
    num_drafts: int = -1  # drafts of the step being planned; -1 when it is not a decode in it
    padded_drafts: int = 0  # drafts its step runs: num_drafts, or more through the padding grant
    unread: int = 0  # its steps that emit and whose outcome the host has not read
    chunk: int = 0  # prompt tokens scheduled in the step being planned
    done: bool = False
    preempted: bool = False

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    @property
    def decoding(self) -> bool:
        return self.admitted is not None and self.scheduled == self.admitted.size

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)


def new_request(prompt: NamedPrompt, max_new_tokens: int, *, vocab_size: int,
                max_seq_len: int) -> Request:
    """``prompt``'s request, once its tokens are in ``[0, vocab_size)`` and its longest
    sequence fits ``max_seq_len``."""
    ids = np.asarray(prompt.token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise EngineError(f"token_ids: prompt {prompt.req_id!r} needs at least one token")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise EngineError(f"token_ids: prompt {prompt.req_id!r} has a token outside the "
                          f"vocabulary [0, {vocab_size})")
    # The last generated token is never fed to the model, hence the - 1.
    longest = ids.size + max_new_tokens - 1
    if longest > max_seq_len:
        raise EngineError(f"max_new_tokens: prompt {prompt.req_id!r} would reach {longest} "
                          f"tokens, more than the pool's max_seq_len {max_seq_len}")
    return Request(prompt.req_id, ids, max_new_tokens)


def handles(requests: list[Request]) -> np.ndarray:
    """The service's handles of ``requests``, an int64 column."""
    return np.fromiter((r.handle for r in requests), dtype=np.int64, count=len(requests))


def int64s(values: Iterable[int]) -> np.ndarray:
    """``values`` as an int64 column."""
    return np.fromiter(values, dtype=np.int64)
