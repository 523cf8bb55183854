"""Writer fences: pool writes that stop, on the device, once their writer's session has ended.

A writer (a worker's session) holds one *word* in a table its owner keeps (`FenceWords`): the
word holds the session's number while the session is open and `CLOSED` once it has ended. Every
commit write carries its writer's `WriterFence`, the word and the number the writer expects in
it, and the write kernel itself reads the word on the device before it writes: a word that no
longer holds the expected number makes the whole write a no-op. So a writer that stalled (a
stopped process, a launch queued behind a long forward) and resumes after its session ended
writes nothing, whatever it launched, and needs no host round trip to learn so.

The owner closes a word before it frees the session's blocks (`FenceWords.close`): on a CUDA
device it waits for the closing write to land, so the close happens-before any reuse of the
blocks. A write that read its word before the close may still finish: on a GPU that is a kernel
already running when the close lands (microseconds); on a CPU pool it is a writer stopped between
its read of the word and the end of that one layer's copy.

Invariants (`FenceWords.check_invariants`): a word is open (holds a number >= 0) exactly when
its slot is handed out; numbers are never `CLOSED`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from kvalloc.allocator.errors import InvariantViolation, NworInputError

CLOSED = -1  # no session number is negative

Allocate = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


class WriterFence(NamedTuple):
    """What a write checks: ``word`` (int64 ``[1]``, the owner's) must equal ``expected``
    (int64 ``[1]``, the writer's), both on the pool's device."""

    word: torch.Tensor
    expected: torch.Tensor

    @classmethod
    def of(cls, word: torch.Tensor, session: int) -> WriterFence:
        """The fence of ``session`` over ``word`` (a one-element view of the owner's table)."""
        if word.dtype != torch.int64 or word.numel() != 1:
            raise NworInputError("fence: the word must be one int64 element", field="fence")
        if session < 0:
            raise NworInputError(f"fence: session {session} is negative", field="fence")
        return cls(word.view(1), torch.full((1,), session, dtype=torch.int64,
                                            device=word.device))

    def is_open(self) -> bool:
        """Whether the word still holds the expected number (a read back on CUDA)."""
        return bool(torch.equal(self.word, self.expected))

    def check(self, device: torch.device) -> None:
        if (self.word.device != device or self.expected.device != device
                or self.word.dtype != torch.int64 or self.expected.dtype != torch.int64
                or self.word.numel() != 1 or self.expected.numel() != 1):
            raise NworInputError(f"fence: expected two int64 [1] tensors on {device}",
                                 field="fence")


class FenceWords:
    """The owner's table of words, one slot per open session, made with ``allocate`` (shared
    memory or CUDA IPC memory, so that writers in other processes map it)."""

    def __init__(self, slots: int, device: torch.device, allocate: Allocate,
                 name: str = "fence_words") -> None:
        self.words = allocate(name, (slots,), torch.int64, device)
        self.words.fill_(CLOSED)
        self._sessions: dict[int, int] = {}  # slot -> the session it holds

    def open(self, session: int) -> int:
        """A free slot, its word set to ``session``; the slot's index."""
        if session < 0:
            raise NworInputError(f"fence: session {session} is negative", field="session")
        slot = next((i for i in range(self.words.numel()) if i not in self._sessions), None)
        if slot is None:
            raise NworInputError(f"fence: all {self.words.numel()} words are open",
                                 field="session")
        self.words[slot] = session
        self._sessions[slot] = session
        return slot

    def close(self, slot: int) -> None:
        """Close ``slot``'s word; returns once no later write of its writer can land."""
        self.words[slot] = CLOSED
        if self.words.is_cuda:
            torch.cuda.synchronize(self.words.device)
        self._sessions.pop(slot, None)

    def fence(self, slot: int) -> WriterFence:
        """The fence of the session ``slot`` holds, over this process's view of its word."""
        return WriterFence.of(self.words[slot:slot + 1], self._sessions[slot])

    def check_invariants(self) -> None:
        """Reads the words back: a synchronisation on CUDA."""
        words = self.words.tolist()
        for slot, word in enumerate(words):
            if (slot in self._sessions) != (word != CLOSED) or (
                    slot in self._sessions and word != self._sessions[slot]):
                raise InvariantViolation(f"fence words: slot {slot} holds {word}, its session "
                                         f"is {self._sessions.get(slot)}")
