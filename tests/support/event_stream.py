"""One KV event stream on loopback TCP, published from a test: the service's sender with a single
stream, as a test of a subscriber needs it."""

from __future__ import annotations

from kvalloc.allocator import KVCacheEvent
from kvalloc.server.service.events.access import EventAccess
from kvalloc.server.service.events.sender import EventSender
from kvalloc.server.service.events.stream import StreamFormat
from pydantic import SecretStr

ANY_PORT = "tcp://127.0.0.1:*"


class OneStream:
    def __init__(self, secret: str | None = None, **form: object) -> None:
        """``secret``: the events secret (CURVE); none: a plain stream."""
        access = (EventAccess(plaintext=True) if secret is None
                  else EventAccess(secret=SecretStr(secret)))
        self.sender = EventSender(StreamFormat(**form), access)
        bound = self.sender.open("s", ANY_PORT, ANY_PORT, [])
        self.endpoint, self.replay_endpoint = bound.events, bound.replay

    def publish(self, events: list[KVCacheEvent]) -> None:
        self.sender.publish("s", events)

    def flush(self) -> None:
        self.sender.flush()

    def close(self) -> None:
        self.sender.close()
