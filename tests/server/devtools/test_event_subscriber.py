"""`KVEventSubscriber` on real ZeroMQ sockets: it rebuilds the publisher's cached set, replays
what came before it joined and any later gap, asks again after a refused replay, counts batches
the publisher no longer holds as lost, names events that contradict its view, and tells a
refused handshake (no events secret) from a quiet stream."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from event_stream import OneStream
from kvalloc.allocator.capacity.kv_events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    router_hashes,
)
from kvalloc.server.contract.errors import HandshakeFailed
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.devtools.event_subscriber import KVEventSubscriber
from kvalloc.server.service.events.stream import END_OF_REPLAY, REPLAY_REFUSED

SECRET = "the-events-secret"
# A handshake or a batch on loopback takes about a millisecond; a loaded two-core machine may
# take far longer.
WAIT_MS = 10_000
TPB = 4


def stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, list(range(len(hashes) * TPB)), TPB, None, MEDIUM_POOL, None)


def test_a_late_subscriber_replays_what_came_before_and_follows_the_stream() -> None:
    publisher = OneStream(SECRET)
    publisher.publish([AllBlocksCleared()])
    publisher.publish([stored([1, 2])])
    publisher.flush()  # both sent before the subscriber connects
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, secret=SECRET)
    try:
        sub.wait_connected(WAIT_MS / 1000)
        published = 2
        # PUB drops what it sends before the subscription arrives: publish until one arrives.
        while True:
            publisher.publish([stored([100 + published], parent=1)])
            published += 1
            if sub.receive(WAIT_MS // 100):
                break
        publisher.publish([BlockRemoved([2], MEDIUM_POOL)])
        published += 1
        while sub.last_seq < published - 1 and sub.receive(WAIT_MS):
            pass
        assert sub.catch_up() == 0  # every batch is in already
    finally:
        sub.close()
        publisher.close()
    counts = sub.counts
    assert counts.joined_at is not None and counts.joined_at >= 2
    # The replay returns what the publisher sent before it answered: the live one too, or more.
    assert counts.replayed >= counts.joined_at and counts.batches == published
    assert (counts.gaps, counts.lost, counts.anomalies) == (0, 0, 0)
    assert sub.cached == {1, *range(102, 100 + published - 1)}


def test_a_subscriber_without_the_events_secret_is_told_its_handshake_was_refused() -> None:
    publisher = OneStream(SECRET)
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, secret="another")
    try:
        with pytest.raises(HandshakeFailed, match="needs the events secret"):
            sub.wait_connected(WAIT_MS / 1000)
    finally:
        sub.close()
        publisher.close()


def payload(*events: KVCacheEvent) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(0.0, list(events)))


BATCHES = [payload(AllBlocksCleared()), payload(stored([1])), payload(stored([2], parent=1)),
           payload(BlockRemoved([1], MEDIUM_POOL))]


class ScriptedPublisher:
    """A publisher on raw sockets that sends some batches live and answers replay requests
    from a script: each answer is a list of ``(seq, payload)``, or None for a refusal."""

    def __init__(self, answers: list[list[int] | None], batches: list[bytes]) -> None:
        self.batches = batches
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.answers = answers
        self.requests: list[int] = []
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def endpoints(self) -> tuple[str, str]:
        return (self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    def send(self, seqs: list[int]) -> None:
        assert self.pub.poll(WAIT_MS)  # the subscription arrived: nothing sent is dropped
        self.pub.recv()
        for seq in seqs:
            self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), self.batches[seq]])

    def _answer(self) -> None:
        for answer in self.answers:
            if not self.router.poll(WAIT_MS):
                return
            identity, _, start = self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if answer is None:
                self.router.send_multipart([identity, b"", REPLAY_REFUSED, b"slow down"])
                continue
            for seq in answer:
                self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"),
                                            self.batches[seq]])
            self.router.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self.thread.join(WAIT_MS / 1000)
        self.context.destroy(linger=0)


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedPublisher]]:
    made: list[ScriptedPublisher] = []

    def make(answers: list[list[int] | None], batches: list[bytes] = BATCHES) -> ScriptedPublisher:
        made.append(ScriptedPublisher(answers, batches))
        return made[-1]

    yield make
    for publisher in made:
        publisher.close()


def follow(publisher: ScriptedPublisher, live: list[int], **options: Any) -> KVEventSubscriber:
    sub = KVEventSubscriber(*publisher.endpoints(), **options)
    try:
        publisher.send(live)
        while sub.last_seq < live[-1] and sub.receive(WAIT_MS):
            pass
    finally:
        sub.close()
    return sub


def test_a_gap_is_replayed_after_a_refusal(scripted) -> None:
    publisher = scripted([None, [2, 3]])
    sub = follow(publisher, [0, 1, 3])
    assert publisher.requests == [2, 2]
    counts = sub.counts
    assert (counts.joined_at, counts.gaps, counts.refusals, counts.replayed) == (0, 1, 1, 2)
    assert (counts.batches, counts.lost, counts.anomalies) == (4, 0, 0)
    assert sub.cached == {2}


def test_batches_the_publisher_no_longer_holds_are_lost_and_the_view_goes_on(scripted) -> None:
    publisher = scripted([[]])  # the buffer moved past batch 2
    sub = follow(publisher, [0, 1, 3])
    counts = sub.counts
    assert (counts.gaps, counts.replayed, counts.lost, counts.batches) == (1, 0, 1, 3)
    assert sub.cached == set()  # batch 2's store never seen: batch 3 removed block 1 alone


def test_events_that_contradict_the_view_are_named(scripted) -> None:
    publisher = scripted([[]])
    sub = follow(publisher, [0, 2, 3])  # batch 1 lost: its store of block 1 never seen
    counts = sub.counts
    assert counts.lost == 1 and counts.anomalies == 2
    assert counts.described == ["batch 2: BlockStored under parent 0x1, not cached",
                                "batch 3: BlockRemoved of 1 hashes never stored"]


def test_a_replay_nobody_answers_ends_and_counts_its_batches_lost(scripted) -> None:
    publisher = scripted([])  # the replay socket never answers
    sub = follow(publisher, [0, 1, 3], replay_timeout_s=0.5)  # nothing will come: no need to wait
    counts = sub.counts
    assert counts.described == ["no end of the replay from batch 2 within 0.5s"]
    assert (counts.lost, counts.batches) == (1, 3)
    assert sub.cached == set()


PROMPT = np.arange(2 * TPB)


def stored_from_the_root(namespace: bytes) -> bytes:
    return payload(BlockStored(router_hashes(PROMPT, TPB, namespace=namespace), None,
                               PROMPT.tolist(), TPB, None, MEDIUM_POOL, None))


@pytest.mark.parametrize(("known", "checked", "anomalies"), [(["a", "b"], 1, 0), (["a"], 0, 1)])
def test_blocks_stored_from_the_root_hash_as_in_a_known_namespace(
        scripted, known: list[str], checked: int, anomalies: int) -> None:
    batches = [payload(AllBlocksCleared()), stored_from_the_root(worker_salt("b", {}))]
    sub = follow(scripted([], batches), [0, 1],
                 namespaces=[worker_salt(worker_id, {}) for worker_id in known])
    assert (sub.counts.roots_checked, sub.counts.anomalies) == (checked, anomalies)
    assert sub.cached == set(router_hashes(PROMPT, TPB, namespace=worker_salt("b", {})))
