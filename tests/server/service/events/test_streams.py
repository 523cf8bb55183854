"""Which stream an event goes on: with ``{worker}``, each worker's stream starts from what its
namespace holds and then carries that namespace's events (and every namespace's clears) alone,
until its session ends; without it, one stream carries everything."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq
from kvalloc.allocator import AllBlocksCleared, BlockRemoved, BlockStored, NamespacedEvent
from kvalloc.server.service.events.access import EventAccess
from kvalloc.server.service.events.stream import StreamFormat
from kvalloc.server.service.events.streams import EventStreams

REPLAY_WAIT_MS = 10_000


def stored(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2], 2, None, "GPU", None)


def replayed(context: zmq.Context, endpoint: str) -> list[list[dict]]:
    """Every batch of a stream, from the start, as a router that joins late reads them."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(REPLAY_WAIT_MS)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append(msgspec.msgpack.decode(payload)[1])
    finally:
        dealer.close(linger=0)


def hashes(batches: list[list[dict]]) -> list[tuple[str, list[int]]]:
    return [(e["type"], e.get("block_hashes", [])) for batch in batches for e in batch]


def test_a_workers_stream_starts_from_its_namespace_and_carries_it_alone(
        tmp_path: Path, zmq_context: zmq.Context):
    held = {b"a": [stored(1)], b"b": [stored(2)]}
    streams = EventStreams(f"ipc://{tmp_path}/ev-{{worker}}", f"ipc://{tmp_path}/re-{{worker}}",
                           StreamFormat(), EventAccess(), lambda ns: held[ns])
    try:
        streams.open_worker("alice", b"a")
        streams.open_worker("bob", b"b")
        streams.publish([NamespacedEvent(b"a", stored(3)), NamespacedEvent(b"b", stored(4)),
                         NamespacedEvent(b"a", BlockRemoved([1], "GPU")),
                         NamespacedEvent(None, AllBlocksCleared())])
        streams.sender.flush()
        alice = hashes(replayed(zmq_context, f"ipc://{tmp_path}/re-alice"))
        bob = hashes(replayed(zmq_context, f"ipc://{tmp_path}/re-bob"))
        assert alice == [("AllBlocksCleared", []), ("BlockStored", [1]), ("BlockStored", [3]),
                         ("BlockRemoved", [1]), ("AllBlocksCleared", [])]
        assert bob == [("AllBlocksCleared", []), ("BlockStored", [2]), ("BlockStored", [4]),
                       ("AllBlocksCleared", [])]
        assert set(streams.endpoints()) == {"alice", "bob"}
        streams.close_worker("bob")
        streams.publish([NamespacedEvent(b"b", stored(5))])
        assert set(streams.endpoints()) == {"alice"}
        assert not (tmp_path / "ev-bob").exists() and not (tmp_path / "re-bob").exists()
        streams.open_worker("bob", b"b")  # again: a new stream, from what the namespace holds
        assert hashes(replayed(zmq_context, f"ipc://{tmp_path}/re-bob")) == [
            ("AllBlocksCleared", []), ("BlockStored", [2])]
    finally:
        streams.close()
    assert list(tmp_path.iterdir()) == []


def test_without_the_placeholder_one_stream_carries_every_namespace(
        tmp_path: Path, zmq_context: zmq.Context):
    streams = EventStreams(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/re", StreamFormat(),
                           EventAccess(), lambda ns: [])
    try:
        assert streams.open_worker("alice", b"a") is None
        streams.publish([NamespacedEvent(None, AllBlocksCleared()),
                         NamespacedEvent(b"a", stored(1)), NamespacedEvent(b"b", stored(2))])
        streams.sender.flush()
        assert hashes(replayed(zmq_context, f"ipc://{tmp_path}/re")) == [
            ("AllBlocksCleared", []), ("BlockStored", [1]), ("BlockStored", [2])]
    finally:
        streams.close()
