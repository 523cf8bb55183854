"""A configuration's pydantic validation errors in a command's words: the flag that set each
field, its value, and the validator's own reason without the library's prefix.

pydantic prefixes what a validator raises ("Value error, ", "Assertion failed, "); a command's
user set a flag and wants the reason, so every command prints errors through here, and the REST
transport's 422 messages take their reason from here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

# What pydantic puts before the message of a ValueError / AssertionError a validator raised.
LIBRARY_PREFIXES = ("Value error, ", "Assertion failed, ")


def reason(error: Mapping[str, Any]) -> str:
    """One pydantic error's message (an entry of ``ValidationError.errors()``), unprefixed."""
    message = str(error["msg"])
    for prefix in LIBRARY_PREFIXES:
        message = message.removeprefix(prefix)
    return message


def reasons(exc: ValidationError) -> str:
    """Every error's reason, ``; `` between them."""
    return "; ".join(reason(error) for error in exc.errors())


def flag_errors(exc: ValidationError) -> str:
    """A configuration's validation errors as the flags that set them: ``--num-blocks -3: Input
    should be greater than 0``, one line each."""
    lines = []
    for error in exc.errors():
        flag = "--" + str(error["loc"][-1]).replace("_", "-") if error["loc"] else "configuration"
        given = f" {error['input']}" if error["loc"] else ""
        lines.append(f"{flag}{given}: {reason(error)}")
    return "\n".join(lines)
