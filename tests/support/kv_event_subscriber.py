"""A KV event subscriber written from vLLM's published message shape alone (no kvalloc types):
raw msgpack ``[ts, [event, ...], rank]``, each event a map tagged ``"type"`` (or, from a service
run with ``--kv-events-shape arrays``, an array tagged by its class name first); three frames
``topic, seq (8 bytes big-endian), payload``; on a gap, a replay request ``[b"", start]``
answered by ``[b"", seq, payload]`` ... ``[b"", -1, b""]``. It keeps the set of cached block
hashes. Given the events secret it connects as kvalloc's docs say a router does: with the CURVE
keys derived from it (`server.contract.routing`); `handshake` tells how a connection's
handshake ended, from ZeroMQ's own monitor events."""

from __future__ import annotations

import time

import msgspec
import zmq
from kvalloc.server.contract.routing import authenticate_subscriber
from zmq.utils.monitor import recv_monitor_message

# Which failure ZeroMQ reports for a refused handshake depends on where it stopped.
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
HANDSHAKE_ENDS = zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILURES)


def watch(socket: zmq.Socket) -> zmq.Socket:
    """A monitor of ``socket``'s handshakes (call before it connects)."""
    return socket.get_monitor_socket(HANDSHAKE_ENDS | zmq.EVENT_DISCONNECTED)


def handshake(monitor: zmq.Socket, timeout_ms: int) -> int | None:
    """The first handshake (or disconnection) event, None if none comes within ``timeout_ms``."""
    if not monitor.poll(timeout_ms):
        return None
    return recv_monitor_message(monitor)["event"]


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _fields(event: dict | list) -> tuple[str, dict]:
    """An event's tag and fields, from either wire shape."""
    if isinstance(event, dict):
        return event["type"], event
    tag, *values = event
    return tag, dict(zip(_ARRAY_FIELDS[tag], values, strict=True))


class Subscriber:
    """Written from vLLM's message shape alone: no kvalloc types."""

    def __init__(self, context: zmq.Context, endpoint: str, replay_endpoint: str,
                 secret: str | None = None, medium: str = "GPU") -> None:
        """``secret``: the events secret (None: a plain socket)."""
        self.context = context
        self.endpoint = endpoint
        self.secret = secret
        self.medium = medium
        self.replay = self._socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.cached: set[int] = set()
        self.token_ids: list[int] = []  # every token id a BlockStored carried
        self.last_seq = -1
        self.replayed = 0
        self.connect()

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self.context.socket(kind)
        if self.secret is not None:
            authenticate_subscriber(socket, self.secret)
        return socket

    def connect(self) -> None:
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        self.sub.connect(self.endpoint)

    def drop(self) -> None:
        self.sub.close(linger=0)

    def apply(self, payload: bytes) -> None:
        ts, events, *_ = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float)
        for event in events:
            tag, fields = _fields(event)
            if tag == "BlockStored":
                hashes, parent, token_ids = (fields[k] for k in
                                             ("block_hashes", "parent_block_hash", "token_ids"))
                assert fields["lora_id"] is None and fields["medium"] == self.medium
                assert len(token_ids) == len(hashes) * fields["block_size"]
                assert parent is None or parent in self.cached
                self.cached.update(hashes)
                self.token_ids += token_ids
            elif tag == "BlockRemoved":
                assert fields["medium"] == self.medium
                self.cached.difference_update(fields["block_hashes"])
            else:
                assert tag == "AllBlocksCleared"
                self.cached.clear()

    def receive(self, timeout_ms: int = 2000) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == b"kv-events"
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:
            self.replay.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
            while True:
                _, got, data = self.replay.recv_multipart()
                if got == (-1).to_bytes(8, "big", signed=True):
                    break
                if self.last_seq < int.from_bytes(got, "big") < seq:
                    self.apply(data)
                    self.last_seq = int.from_bytes(got, "big")
                    self.replayed += 1
        if seq == self.last_seq + 1:
            self.apply(payload)
            self.last_seq = seq
        return True

    def catch_up(self, timeout_ms: int, ask_every_ms: int = 1000) -> None:
        """Apply every batch published before this call, read from the replay socket: the
        publisher sends what was queued before it answers a replay, so nothing a step published
        before the call is missed, however late this socket's subscription reached the
        publisher (PUB drops what it sends before then). A request unanswered after
        ``ask_every_ms`` (lost with a connection that was still being made, or refused for the
        replay rate) is asked again; batches already applied are skipped."""
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            self.replay.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
            while self.replay.poll(ask_every_ms):
                _, got, data = self.replay.recv_multipart()
                if got == (-1).to_bytes(8, "big", signed=True):
                    return
                if got == (-2).to_bytes(8, "big", signed=True):
                    break  # refused for the rate: ask again
                if int.from_bytes(got, "big") == self.last_seq + 1:
                    self.apply(data)
                    self.last_seq += 1
        raise TimeoutError(f"no whole replay within {timeout_ms} ms")
