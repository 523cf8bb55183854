"""The server package's one error tree, and the one table from an error to its status and code.

Every error class of the server package is a `KVAllocServerError`, defined here. Where callers
catch a builtin (a timeout, a refused connection, a bad value), the class keeps that base too:

- `ServiceError`: a call the service refuses, raised before any state changes, like the
  allocator's errors (so it is a `KVAllocError` as well). Each subclass carries its HTTP status,
  wire code and the field at fault. `InsufficientMemory` is one too: a segment the service could
  not back with memory, at start or at a registration.
- `RemoteError` and its subclasses: the client's side of a refusal, rebuilt from the
  `ErrorBody` the service answered (`remote_error`); `TransportTimeout` (a `TimeoutError`) and
  `ServiceUnreachable` (a `ConnectionError`): the call got no answer.
- what attaching the pool, addresses, framing and starting the service can fail on:
  `AttachError`, `AddressError`, `NotASocket`, `MessageTooLarge`, `LimitsError`,
  `InsecureBinding`, `PoolTooLarge`, and a KV event subscriber's `HandshakeFailed`.

``describe(exc)`` turns any exception into its `ErrorBody` (status, code, field): REST answers it
as the HTTP status and a JSON body, IPC as an error frame carrying the same body, and the client
turns it back into the same `RemoteError` for either (`remote_error`).
"""

from __future__ import annotations

import kvalloc.allocator as ae
from kvalloc.allocator import KVAllocError
from kvalloc.server.contract import wire


class KVAllocServerError(Exception):
    """Base of every error the server package (contract, service, transports, client) raises."""


class ServiceError(KVAllocServerError, KVAllocError):
    """An error the service (not the allocator) detects. ``status`` is its HTTP status."""

    status: int = 400
    code: str = "bad_request"


class Unauthorized(ServiceError):
    status, code, field = 401, "unauthorized", "authorization"


class UnknownWorker(ServiceError):
    status, code, field = 404, "unknown_worker", "worker_id"


class RequestNotFound(ServiceError):
    status, code, field = 404, "unknown_request", "req_id"


class UnknownHandle(ServiceError):
    """A handle names no live request of the calling worker (freed, another worker's, made up)."""

    status, code = 422, "unknown_handle"


class DuplicateRequestId(ServiceError):
    status, code = 422, "duplicate_request"


class StaleSession(ServiceError):
    """The worker's session ended (it registered again, or was replaced): nothing is applied."""

    status, code, field = 409, "stale_session", "session"


class WorkerIdInUse(ServiceError):
    """Another live session holds the worker id; ``replace`` takes it over explicitly."""

    status, code, field = 409, "worker_id_in_use", "worker_id"


class StaleEpoch(ServiceError):
    """The service restarted: the worker's registration and requests are gone; re-register."""

    status, code, field = 409, "stale_epoch", "epoch"


class StepOutOfOrder(ServiceError):
    status, code, field = 409, "step_out_of_order", "step_id"


class StepIdReused(ServiceError):
    """The last step id again, with a different body: a retry must resend the same step."""

    status, code, field = 409, "step_id_reused", "step_id"


class TooManyWorkers(ServiceError):
    status, code, field = 409, "too_many_workers", "worker_id"


class StepNotSettled(ServiceError):
    """A decode request of the previous step (an overlap worker's: of the step before it) is in
    none of results / reverts / finished."""

    status, code, field = 422, "unsettled_requests", "results"


class WrongRank(ServiceError):
    """A worker of one data-parallel rank registered with the allocator of another."""

    status, code, field = 409, "wrong_rank", "data_parallel_rank"


class UnknownRank(ServiceError):
    """A registration names no data-parallel rank of a service of several, or none at all."""

    status, code, field = 422, "unknown_rank", "data_parallel_rank"


class AttachRequired(ServiceError):
    """A worker that does not attach (``attached`` false) registered with a grouped pool: the
    replies' table changes and slot mappings describe one block table, and a grouped pool has
    one per group, so its workers map the pool (same host)."""

    status, code, field = 422, "attach_required", "attached"


class LimitExceeded(ServiceError):
    """A list is longer, or a step schedules more tokens, than the service allows."""

    status, code = 422, "limit_exceeded"


class BodyTooLarge(ServiceError):
    status, code, field = 413, "body_too_large", "body"


class MalformedBody(ServiceError):
    """The body does not match the schema; ``field`` is the path of the first mismatch."""

    status, code = 422, "invalid_body"


class UnknownOperation(ServiceError):
    status, code, field = 404, "unknown_operation", "op"


class NotReady(ServiceError):
    status, code, field = 503, "not_ready", "service"


class Overloaded(ServiceError):
    """More calls or connections at once than the service takes: retry after Retry-After."""

    status, code, field = 503, "overloaded", "service"


class InsufficientMemory(ServiceError):
    """A shared-memory segment the service promised cannot be backed: its directory (a tmpfs,
    ``/dev/shm``) has fewer free bytes than it needs. Nothing of it is left, nothing changed."""

    status, code, field = 507, "insufficient_memory", "service"


# Allocator errors -> (status, code). Looked up along the MRO, so subclasses inherit a row.
_ALLOCATOR: dict[type[Exception], tuple[int, str]] = {
    ae.GrantPending: (409, "grant_pending"),
    ae.NoPendingGrant: (409, "no_pending_grant"),
    ae.OutOfBlocks: (409, "out_of_blocks"),
    ae.BatchFull: (409, "batch_full"),
    ae.OnboardingPending: (409, "onboarding"),
    ae.BlockTableOverflow: (422, "block_table_overflow"),
    ae.UnknownRequest: (422, "unknown_request"),
    ae.DuplicateRequest: (422, "duplicate_request"),
    ae.AcceptedExceedsDrafts: (422, "accepted_exceeds_drafts"),
    ae.DraftLenExceeded: (422, "draft_len_exceeded"),
    ae.PrefillIncomplete: (409, "prefill_incomplete"),
    ae.InvalidValue: (422, "invalid_value"),
    KVAllocError: (422, "invalid_input"),
}

INTERNAL = 500


def describe(exc: BaseException) -> wire.ErrorBody:
    """The error body for ``exc``; anything that is not a typed input error is a 500."""
    if isinstance(exc, ServiceError):
        return wire.ErrorBody(status=exc.status, code=exc.code, field=exc.field, message=str(exc))
    if isinstance(exc, KVAllocError):
        status, code = next(_ALLOCATOR[c] for c in type(exc).__mro__ if c in _ALLOCATOR)
        return wire.ErrorBody(status=status, code=code, field=exc.field, message=str(exc))
    if isinstance(exc, ae.InvariantViolation):
        return wire.ErrorBody(status=INTERNAL, code="invariant_violation", field="",
                              message=str(exc))
    return wire.ErrorBody(status=INTERNAL, code="internal", field="",
                          message=f"{type(exc).__name__}: {exc}")


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the same dotted path msgspec reports: grants[3].draft_len
    (FastAPI's leading 'body' / 'query' / 'path' is dropped)."""
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


# ---------------------------------------------------------------- the client's side


class RemoteError(KVAllocServerError):
    """The service refused a call; nothing changed there. ``field`` names the input at fault."""

    def __init__(self, body: wire.ErrorBody) -> None:
        super().__init__(f"{body.status} {body.code}: {body.message}")
        self.status, self.code, self.field, self.message = (body.status, body.code, body.field,
                                                            body.message)


class ServiceRestarted(RemoteError):
    """The service's epoch changed: every request is gone. Register again and re-admit."""


class NotRegistered(RemoteError):
    """The worker is unknown to the service (its lease expired): register again."""


class SessionEnded(RemoteError):
    """This worker's session ended (another process registered the id with ``replace``, or the
    lease expired and the id was registered again): register again."""


class TokenRejected(RemoteError):
    """The service requires a bearer token and this client sent none, or a wrong one."""

    def __init__(self, body: wire.ErrorBody, token_sent: bool) -> None:
        super().__init__(body)
        hint = ("the service rejected the token (KVALLOC_TOKEN or token=) as wrong" if token_sent
                else "the service requires a token and none was sent: set KVALLOC_TOKEN")
        self.args = (f"{body.status} {body.code}: {hint}",)


# The refusals a worker answers differently from the rest, by the code the service sent.
_REMOTE: dict[str, type[RemoteError]] = {
    StaleEpoch.code: ServiceRestarted,
    UnknownWorker.code: NotRegistered,
    StaleSession.code: SessionEnded,
}


def remote_error(body: wire.ErrorBody, *, token_sent: bool = False) -> RemoteError:
    """The client's exception for the service's answer ``body``, the way back of `describe`."""
    if body.code == Unauthorized.code:
        return TokenRejected(body, token_sent)
    return _REMOTE.get(body.code, RemoteError)(body)


class TransportTimeout(KVAllocServerError, TimeoutError):
    """No reply within the timeout, after every retry."""


class ServiceUnreachable(KVAllocServerError, ConnectionError):
    """Nothing accepts a connection at the address: no call was delivered."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot reach {address} ({reason}): is kvalloc serve running at "
                         f"{address}?")
        self.address = address


class AttachError(KVAllocServerError, RuntimeError):
    """A handle cannot be mapped here (another host, a removed segment, no CUDA)."""


# ---------------------------------------------------------------- addresses, framing, start


class AddressError(KVAllocServerError, ValueError):
    """An address, port or socket path that cannot work; the message names it and says why."""


class NotASocket(KVAllocServerError, OSError):
    """Something other than a socket file is at a socket path; it is never removed."""


class MessageTooLarge(KVAllocServerError):
    """A message's length prefix exceeds the reader's limit (nothing more of it was read)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


class LimitsError(KVAllocServerError, ValueError):
    """The descriptor limit is too small to serve REST with the reserve kept."""


class InsecureBinding(KVAllocServerError, ValueError):
    """Listening beyond loopback with no token configured."""


class HandshakeFailed(KVAllocServerError, ConnectionError):
    """A KV event socket's handshake was refused (no token, or another service's) or did not
    complete in time: a subscriber would read nothing."""


class PoolTooLarge(KVAllocServerError, ValueError):
    """The pool and the staging buffers need more memory than is free where they would live."""


class ShardingInvalid(KVAllocServerError, ValueError):
    """Devices and a tensor-parallel degree that do not make a service: heads that do not split
    evenly, a device that does not exist, a device count that is not a multiple of the degree.
    Raised before anything of the pool is made."""
