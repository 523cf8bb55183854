"""What a stream connection must show before the listener spends anything on it: the token.

A message announces its length in its first 4 bytes, up to the listener's frame limit (tens of
MiB). Buffering that much for a peer that has not shown the token would let anyone who can open
the socket make the service allocate it, once per connection slot. The token is the message's
second frame, so it sits in the message's first bytes: `token_verified` reads it from there, and
the listener grows its buffer for the rest only once it matched.

The frames are a msgpack array of byte strings (`server.transport.stream.pack`): an array header,
then per frame a bin header and its bytes. Only the array's first two entries are read: the step
sequence (at most `MAX_SEQ_BYTES`), then the token, compared in constant time once whole; a token
frame of another length is wrong without reading it.
"""

from __future__ import annotations

import hmac

from kvalloc.server.contract.errors import MalformedBody, Unauthorized

MAX_SEQ_BYTES = 64  # clients send 8; anything longer is not a client's message
FRAMES = 4  # [seq, token, op, payload]

# msgpack's bin headers (type byte -> width of the length after it), and array headers.
_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_ARRAY = {0xDC: 2, 0xDD: 4}


def token_verified(prefix: memoryview | bytes, complete: bool, token: bytes) -> bool:
    """Whether the message starting with ``prefix`` (all of it when ``complete``) carries
    ``token``; False while more bytes are needed to tell. Raises `Unauthorized` for a wrong
    token and `MalformedBody` for a message that is not frames."""
    at = _array(prefix)
    if at is None:
        return _need_more(complete)
    seq = _bin(prefix, at)
    if seq is None:
        return _need_more(complete)
    seq_at, seq_len = seq
    if seq_len > MAX_SEQ_BYTES:
        raise MalformedBody(f"frames[0]: a {seq_len}-byte sequence number, more than "
                            f"{MAX_SEQ_BYTES}", field="frames")
    given = _bin(prefix, seq_at + seq_len)
    if given is None:
        return _need_more(complete)
    token_at, token_len = given
    if token_len != len(token):
        raise Unauthorized("authorization: missing or wrong token")
    if len(prefix) < token_at + token_len:
        return _need_more(complete)
    if not hmac.compare_digest(bytes(prefix[token_at:token_at + token_len]), token):
        raise Unauthorized("authorization: missing or wrong token")
    return True


def sequence_of(prefix: memoryview | bytes) -> bytes:
    """The sequence frame of the message starting with ``prefix``, to echo in a refusal of it
    (the client matches replies by it); empty where there is none to read."""
    try:
        at = _array(prefix)
        seq = None if at is None else _bin(prefix, at)
    except MalformedBody:
        return b""
    if seq is None or seq[1] > MAX_SEQ_BYTES or len(prefix) < seq[0] + seq[1]:
        return b""
    return bytes(prefix[seq[0]:seq[0] + seq[1]])


def _need_more(complete: bool) -> bool:
    if complete:
        raise MalformedBody("frames: expected [seq, token, op, payload]", field="frames")
    return False


def _array(data: memoryview | bytes) -> int | None:
    """Where the first element of a `FRAMES`-long array begins; None if not yet known."""
    if not data:
        return None
    head = data[0]
    if 0x90 <= head <= 0x9F:
        size, at = head & 0x0F, 1
    elif head in _ARRAY:
        width = _ARRAY[head]
        if len(data) < 1 + width:
            return None
        size, at = int.from_bytes(data[1:1 + width], "big"), 1 + width
    else:
        raise MalformedBody("frames: not a msgpack array of byte strings", field="frames")
    if size != FRAMES:
        raise MalformedBody(f"frames: {size} frames, expected [seq, token, op, payload]",
                            field="frames")
    return at


def _bin(data: memoryview | bytes, at: int) -> tuple[int, int] | None:
    """(where its bytes begin, how many) of the byte string whose header is at ``at``."""
    if len(data) <= at:
        return None
    width = _BIN.get(data[at])
    if width is None:
        raise MalformedBody("frames: not a msgpack array of byte strings", field="frames")
    if len(data) < at + 1 + width:
        return None
    return at + 1 + width, int.from_bytes(data[at + 1:at + 1 + width], "big")
