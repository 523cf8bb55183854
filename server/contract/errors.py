"""Service errors and the one table that turns any error into an `ErrorBody` (status, code, field).

Both transports answer an error with ``describe(exc)``: REST as the HTTP status and a JSON body,
IPC as an error frame carrying the same body, so a client raises the same `ServiceError` for
either. Like the allocator's errors, every service error is raised before any state changes.
"""

from __future__ import annotations

import allocator.errors as ae
from allocator.errors import KVAllocError
from server.contract import wire


class ServiceError(KVAllocError):
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
    """A decode request of the previous step is in none of results / reverts / finished."""

    status, code, field = 422, "unsettled_requests", "results"


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


# Allocator errors -> (status, code). Looked up along the MRO, so subclasses inherit a row.
_ALLOCATOR: dict[type[Exception], tuple[int, str]] = {
    ae.GrantPending: (409, "grant_pending"),
    ae.NoPendingGrant: (409, "no_pending_grant"),
    ae.OutOfBlocks: (409, "out_of_blocks"),
    ae.BatchFull: (409, "batch_full"),
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

