"""`CallPacer`: a connection polls for its next call only around when it is due, and only after
an answer that was not an error."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from kvalloc.server.transport import polling, stream
from kvalloc.server.transport.polling import (
    BLOCK,
    CONTENDED_S,
    HORIZON_S,
    CallPacer,
    Wait,
    poll_for,
    wait_for,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(budget_s: float = 0.002) -> tuple[CallPacer, Clock]:
    clock = Clock()
    return CallPacer(budget_s, history=3, clock=clock), clock


def call_after(pacer: CallPacer, clock: Clock, gap_s: float, *, ok: bool = True) -> None:
    """The answer, then the next call ``gap_s`` later."""
    pacer.answered(ok=ok)
    pacer.next_wait()
    clock.now += gap_s
    pacer.arrived()


def test_before_any_answer_and_without_a_budget_the_wait_blocks() -> None:
    pacer, _ = paced()
    assert pacer.next_wait() == BLOCK
    idle, _ = paced(budget_s=0.0)
    idle.answered(ok=True)
    assert idle.next_wait() == BLOCK


def test_with_no_gap_known_the_poll_starts_at_once() -> None:
    pacer, _ = paced()
    pacer.answered(ok=True)
    assert pacer.next_wait() == Wait(0.0, 0.002)


def test_the_poll_starts_a_quarter_budget_before_the_shortest_recent_gap() -> None:
    pacer, clock = paced()
    for gap in (0.012, 0.010, 0.011):
        call_after(pacer, clock, gap)
    pacer.answered(ok=True)
    assert pacer.next_wait() == Wait(pytest.approx(0.010 - 0.0005), 0.002)
    clock.now += 0.011
    pacer.arrived()
    for gap in (0.020, 0.020):  # the 0.010 gap leaves the history of three
        call_after(pacer, clock, gap)
    pacer.answered(ok=True)
    assert pacer.next_wait() == Wait(pytest.approx(0.011 - 0.0005), 0.002)


def test_time_since_the_answer_counts_against_the_wait() -> None:
    pacer, clock = paced()
    call_after(pacer, clock, 0.010)
    for since, wait in ((0.004, Wait(pytest.approx(0.0095 - 0.004), 0.002)),
                        (0.010, Wait(0.0, pytest.approx(0.0015))),  # inside the window
                        (0.012, BLOCK)):  # past it
        pacer.answered(ok=True)
        clock.now += since
        assert pacer.next_wait() == wait
        clock.now += 0.010 - since
        pacer.arrived()


def test_a_caller_back_to_back_is_polled_for_at_once() -> None:
    pacer, clock = paced()
    call_after(pacer, clock, 0.0002)
    pacer.answered(ok=True)
    assert pacer.next_wait() == Wait(0.0, 0.002)


def test_a_wait_sleeps_in_the_kernel_only_for_a_millisecond_or_more() -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> bool:
        sleeps.append(seconds)
        return False

    assert not wait_for(BLOCK, sleep, lambda: True)  # no wait: straight to blocking
    assert wait_for(Wait(0.0006, 0.001), sleep, lambda: True) and sleeps == []
    assert wait_for(Wait(0.005, 0.001), sleep, lambda: True) and sleeps == [0.005]
    assert wait_for(Wait(0.005, 0.001), lambda seconds: True, lambda: False)  # came asleep


def test_each_answer_earns_one_wait_and_an_error_none() -> None:
    pacer, clock = paced()
    pacer.answered(ok=True)
    assert pacer.next_wait() != BLOCK
    assert pacer.next_wait() == BLOCK  # the poll ran out: block until the call comes
    clock.now += 0.005
    pacer.arrived()
    pacer.answered(ok=False)
    assert pacer.next_wait() == BLOCK


def test_a_call_further_off_than_the_horizon_is_not_polled_for() -> None:
    pacer, clock = paced()
    call_after(pacer, clock, 2 * HORIZON_S)
    pacer.answered(ok=True)
    assert pacer.next_wait() == BLOCK


@pytest.mark.parametrize(("send_after_s", "sleep_s"), [(0.01, 1.0), (0.08, 0.05)])
def test_a_message_coming_while_the_inbox_sleeps_or_polls_is_read(
        send_after_s: float, sleep_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sleeping, then polling 100 ms: a message sent during either is read whole, and the
    inbox polls only once its sleep is over."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.set_timeouts(mine, 5.0)
    inbox = stream.Inbox(mine)
    polls: list[float] = []  # when each poll began
    poll = polling.poll_for

    def counted(*args: Any) -> bool:
        polls.append(time.perf_counter())
        return poll(*args)

    monkeypatch.setattr(polling, "poll_for", counted)
    sender = threading.Timer(send_after_s, theirs.sendall, [stream.pack([b"a", b"b"])])
    began = time.perf_counter()
    sender.start()
    try:
        assert inbox.next_message(wait=Wait(sleep_s, 0.1)) == [b"a", b"b"]
    finally:
        sender.join()
        mine.close()
        theirs.close()
    if send_after_s < sleep_s:
        assert polls == []  # it came during the sleep
    else:
        assert polls and polls[0] - began >= sleep_s - 1e-3


def test_a_poll_that_loses_its_core_gives_up_and_lets_the_caller_block() -> None:
    """An iteration that took longer than `CONTENDED_S` (here: a ``ready`` that sleeps, as a
    thread preempted on a busy core) ends the poll long before its time is up."""
    calls: list[int] = []

    def slow_not_ready() -> bool:
        calls.append(1)
        time.sleep(2 * CONTENDED_S)
        return False

    began = time.perf_counter()
    assert not poll_for(slow_not_ready, 5.0)
    assert time.perf_counter() - began < 1.0
    assert len(calls) == 1


def test_a_poll_returns_as_soon_as_ready_and_stops_with_its_flag() -> None:
    assert poll_for(lambda: True, 5.0)
    stop = threading.Event()
    stop.set()
    began = time.perf_counter()
    assert not poll_for(lambda: False, 5.0, stop)
    assert time.perf_counter() - began < 1.0


def test_a_peer_that_closes_while_the_inbox_sleeps_ends_the_stream_between_messages() -> None:
    """A close seen by the kernel wait is a close between messages (None), not one inside a
    message."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.set_timeouts(mine, 5.0)
    inbox = stream.Inbox(mine)
    closer = threading.Timer(0.01, theirs.close)
    closer.start()
    try:
        assert inbox.next_message(wait=Wait(1.0, 0.1)) is None
    finally:
        closer.join()
        mine.close()
