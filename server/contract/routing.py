"""What a KV-aware router and the service agree on: the namespace each worker's prompts are cached
under, the secret seed of the block hashes, and the CURVE keys of the KV events.

Namespaces: a worker's prompts are hashed under its own salt, so workers share cached blocks only
inside one namespace (`allocator.capacity.prefix_cache.chain_root`). A worker is alone in its
namespace unless the operator puts its id in a group (``kvalloc serve --cache-group
NAME=ID,ID``): ``worker_salt`` is ``b"worker\\0" + id`` alone, ``b"group\\0" + NAME`` grouped.

Seed: the block hashes' root is keyed with ``hash_seed(secret)``, 32 bytes of BLAKE2b over the
deployment's secret (``KVALLOC_HASH_SEED``; random per start without it, never the service
token): a router given the secret computes the hashes of a prompt as the service does, nobody
else can.

KV events over TCP: both sides derive CURVE keys (ZeroMQ's authenticated encryption) from the
events-only secret (``KVALLOC_EVENTS_SECRET``, which workers are not given): each secret key is
BLAKE2b-256 of it under its own personalisation (``kvalloc-ev-srv``, ``kvalloc-ev-sub``),
z85-encoded, and each public key follows from its secret key (`zmq.curve_public`). The service
admits the subscriber key alone, so only a holder of that secret can subscribe or ask for a
replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import zmq
import zmq.utils.z85

SEED_BYTES = 32


def worker_salt(worker_id: str, groups: Mapping[str, Sequence[str]]) -> bytes:
    """The salt ``worker_id``'s prompts are hashed under: its group's, else its own."""
    group = next((name for name, ids in groups.items() if worker_id in ids), None)
    return (b"worker\0" + worker_id.encode()) if group is None else (b"group\0" + group.encode())


def hash_seed(secret: str) -> bytes:
    """The key of the block hashes' root, from a deployment's secret."""
    return hashlib.blake2b(secret.encode(), digest_size=SEED_BYTES,
                           person=b"kvalloc-hseed").digest()


class CurveKeys(NamedTuple):
    """z85-encoded CURVE key pairs of the KV event sockets and of their subscribers."""

    server_public: bytes
    server_secret: bytes
    subscriber_public: bytes
    subscriber_secret: bytes


def _secret_key(secret: str, person: bytes) -> bytes:
    raw = hashlib.blake2b(secret.encode(), digest_size=32, person=person).digest()
    return zmq.utils.z85.encode(raw)


def curve_keys(secret: str) -> CurveKeys:
    """The KV events' keys for the events secret ``secret`` (``KVALLOC_EVENTS_SECRET``)."""
    server = _secret_key(secret, b"kvalloc-ev-srv")
    subscriber = _secret_key(secret, b"kvalloc-ev-sub")
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(subscriber), subscriber)


def authenticate_subscriber(socket: zmq.Socket, secret: str) -> None:
    """Make ``socket`` (a SUB or DEALER, before it connects) present the subscriber key of the
    events secret ``secret`` and require the service's."""
    keys = curve_keys(secret)
    socket.curve_secretkey = keys.subscriber_secret
    socket.curve_publickey = keys.subscriber_public
    socket.curve_serverkey = keys.server_public
