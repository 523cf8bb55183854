"""The token check on a stream message's first bytes: it needs only the bytes up to the token's
end, whatever the message's length, and tells a wrong token or a message that is not frames
without reading further."""

from __future__ import annotations

import pytest
from kvalloc.server.contract.errors import MalformedBody, Unauthorized
from kvalloc.server.transport import stream
from kvalloc.server.transport.gate import MAX_SEQ_BYTES, sequence_of, token_verified

TOKEN = b"t" * 43  # the length of a generated token


def message(token: bytes, payload: bytes = b"p" * 100_000, seq: bytes = b"\x00" * 8) -> bytes:
    return stream.pack([seq, token, b"step", payload])[stream.LENGTH.size:]


def test_the_token_is_known_from_the_first_bytes_of_a_message_of_any_length() -> None:
    body = message(TOKEN)
    needed = next(n for n in range(len(body)) if token_verified(body[:n], False, TOKEN))
    assert needed < 64  # array, seq and token headers, 8 + 43 bytes
    assert not any(token_verified(body[:n], False, TOKEN) for n in range(needed))
    assert token_verified(body, True, TOKEN)


@pytest.mark.parametrize("given", [b"", b"t" * 42, b"t" * 44, b"u" + b"t" * 42])
def test_a_wrong_token_is_refused_as_soon_as_it_is_known(given: bytes) -> None:
    body = message(given)
    header_end = 1 + 2 + 8 + 2  # a wrong length is known from the token's header
    cut = header_end if len(given) != len(TOKEN) else header_end + len(given)
    with pytest.raises(Unauthorized):
        token_verified(body[:cut], False, TOKEN)


@pytest.mark.parametrize("body", [
    b"\x93\xc4\x01a\xc4\x01b\xc4\x01c",  # three frames
    b"\x84\xa1a\x01",  # a map
    b"\x94\xa1a",  # a str where bytes belong
    stream.pack([b"s" * (MAX_SEQ_BYTES + 1), TOKEN, b"op", b""])[4:],
])
def test_a_message_that_is_not_frames_is_named(body: bytes) -> None:
    with pytest.raises(MalformedBody) as info:
        token_verified(body, False, TOKEN)
    assert info.value.field == "frames"


def test_a_whole_message_too_short_to_hold_a_token_is_malformed() -> None:
    body = b"\x94\xc4\x01a"
    assert not token_verified(body, False, TOKEN)
    with pytest.raises(MalformedBody):
        token_verified(body, True, TOKEN)


def test_a_refusal_echoes_the_sequence_number_it_can_read() -> None:
    seq = (41).to_bytes(8, "big")
    assert sequence_of(message(b"wrong", seq=seq)[:12]) == seq
    assert sequence_of(message(b"wrong", seq=seq)[:8]) == b""  # not all of it yet
    assert sequence_of(b"\x84\xa1a\x01") == b""
