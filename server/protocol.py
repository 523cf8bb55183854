"""The service contract: one pydantic model per operation's input and reply.

REST validates bodies with these models and generates its OpenAPI document from them;
`server.wire` derives the msgspec structs that the IPC transport, the service core and the client
use from these same classes, so the two transports cannot drift apart. Every constraint is declared
once, through `_constrained`, in the vocabulary both libraries read (pydantic's ``Field`` and
msgspec's ``Meta`` take the same keywords).

Request ids live in their worker's namespace: two workers may both have a request ``"r1"``, and a
worker can neither see nor touch another worker's requests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
INT63_MAX = 2**63 - 1


def _constrained(base: type, **limits: Any) -> Any:
    """``base`` with ``limits`` that both pydantic and msgspec enforce."""
    return Annotated[base, Field(**limits), msgspec.Meta(**limits)]


# Worker ids name shared-memory segments too, hence the conservative alphabet.
WORKER_ID_LIMITS: dict[str, Any] = {"min_length": 1, "max_length": 64,
                                    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$"}
REQ_ID_LIMITS: dict[str, Any] = {"min_length": 1, "max_length": 256}

WorkerId = _constrained(str, **WORKER_ID_LIMITS)
ReqId = _constrained(str, **REQ_ID_LIMITS)
Count = _constrained(int, ge=0, le=INT32_MAX)
Positive = _constrained(int, ge=1, le=INT32_MAX)
Serial = _constrained(int, ge=0, le=INT63_MAX)


class Contract(BaseModel):
    """Base of every message: unknown fields are an error, messages are values, and types are
    strict (``"7"`` is not an int), as msgspec is, so both transports accept the same bodies."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# ---------------------------------------------------------------- errors


class ErrorBody(Contract):
    """Every error, on both transports. ``field`` names the input at fault (dotted path)."""

    status: int = Field(description="HTTP status; the IPC transport sends the same number.")
    code: str = Field(description="Stable machine-readable error code, e.g. 'stale_epoch'.")
    field: str = Field(description="The input at fault, e.g. 'grants[3].draft_len'.")
    message: str


# ---------------------------------------------------------------- registration and attach


class RegisterRequest(Contract):
    """Register (or re-register) a worker. Re-registering frees every request it held."""

    worker_id: WorkerId


class WorkerRef(Contract):
    worker_id: WorkerId


class ShmRef(Contract):
    """A POSIX shared-memory segment (mode 0600) under /dev/shm."""

    name: str = Field(description="Segment name; the file is /dev/shm/<name>.")
    nbytes: int


class CudaRef(Contract):
    """A CUDA IPC memory handle, the fields of ``UntypedStorage._share_cuda_()`` in hex."""

    device: int
    handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None = None
    event_sync_required: bool = False


class TensorHandle(Contract):
    """One tensor shared without copying: exactly one of ``shm`` / ``cuda`` is set."""

    dtype: str = Field(description="torch dtype name, e.g. 'bfloat16'.")
    shape: list[int]
    stride: list[int]
    storage_offset: int = Field(description="In elements.")
    shm: ShmRef | None = None
    cuda: CudaRef | None = None


class EventHandle(Contract):
    """An interprocess CUDA event (``torch.cuda.Event(interprocess=True).ipc_handle()``)."""

    device: int
    handle: str


class Attachment(Contract):
    """What a same-host worker maps: the pool, the block table and its own staging buffer.

    ``kv`` is ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` (K at
    index 0, V at 1); ``block_table`` is int32 ``[max_batch_size, max_blocks_per_seq]``, -1 past a
    request's blocks; ``staging`` is ``[num_layers, 2, max_step_tokens, num_kv_heads, head_dim]``:
    the worker writes token i of a step (``slot_mapping[i]``) at ``staging[layer, 0 or 1, i]``.
    On CUDA the worker records ``forward_done`` after its forward and waits on ``commit_done``
    before its next forward; on CPU both are absent.
    """

    kv: TensorHandle
    block_table: TensorHandle
    staging: TensorHandle
    forward_done: EventHandle | None = None
    commit_done: EventHandle | None = None


class PoolLayout(Contract):
    num_blocks: int
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    staging_dtype: str
    device: str
    max_batch_size: int
    max_blocks_per_seq: int
    max_draft_len: int
    max_step_tokens: int
    overlap_scheduler: bool
    k_scales: list[float] | None = None
    v_scales: list[float] | None = None


class Registration(Contract):
    worker_id: str
    epoch: int = Field(description="The service's epoch; send it with every step.")
    lease_ttl_s: float = Field(description="A worker silent this long loses its requests.")
    next_step_id: int = Field(description="Step ids start here and only increase.")
    layout: PoolLayout
    attachment: Attachment


class Deregistered(Contract):
    worker_id: str
    freed_requests: int


# ---------------------------------------------------------------- the per-step call


class Result(Contract):
    """The previous step's accepted draft count for one request (commit + update_resources)."""

    req_id: ReqId
    num_accepted: Count


class Grant(Contract):
    """A generation grant for this step: 1 + draft_len tokens (+ overlap slack)."""

    req_id: ReqId
    draft_len: Count


class Padding(Contract):
    """CUDA-graph padding: run this step's grant with ``padded_draft_len`` drafts."""

    req_id: ReqId
    padded_draft_len: Count


class PrefillChunk(Contract):
    req_id: ReqId
    num_tokens: Positive


class NewRequest(Contract):
    req_id: ReqId
    prompt_len: Positive
    first_chunk: Positive | None = Field(
        default=None, description="Tokens of the prompt scheduled now; None: the whole prompt."
    )


class StepRequest(Contract):
    """One scheduler step. Applied atomically, in this order: reverts, results, finished, grants
    and padding, prefill, new. Every request of the previous step must appear in exactly one of
    ``results``, ``reverts`` or ``finished``.

    ``step_id`` must exceed the last applied one; repeating the last one returns its reply again
    without applying anything.
    """

    worker_id: WorkerId
    epoch: Serial
    step_id: Serial
    results: list[Result] = Field(default_factory=list)
    reverts: list[ReqId] = Field(default_factory=list)
    finished: list[ReqId] = Field(default_factory=list)
    grants: list[Grant] = Field(default_factory=list)
    padding: list[Padding] = Field(default_factory=list)
    prefill: list[PrefillChunk] = Field(default_factory=list)
    new: list[NewRequest] = Field(default_factory=list)


class Scheduled(Contract):
    """A request in this step's forward. Its tokens are ``token_offset .. token_offset +
    num_tokens`` of the step, at positions ``start_position ..``; the last ``num_drafts`` are
    drafts."""

    req_id: str
    kind: Literal["decode", "prefill"]
    row: int
    token_offset: int
    num_tokens: int
    num_drafts: int
    start_position: int


class Refused(Contract):
    """Not scheduled this step; nothing changed for it, so the scheduler can preempt or retry."""

    req_id: str
    kind: Literal["grant", "prefill", "new"]
    reason: Literal["out_of_blocks", "batch_full"]


class TableUpdate(Contract):
    """Block-table row change: ``row[start:start + len(block_ids)] = block_ids`` and
    ``row[num_blocks:] = -1``. A freed request has ``num_blocks`` 0."""

    req_id: str
    row: int
    start: int
    block_ids: list[int]
    num_blocks: int


class CommitSummary(Contract):
    """What the previous step's commit wrote into the pool."""

    tokens: int = Field(description="Tokens the previous step staged.")
    written: int = Field(description="Tokens written into the pool.")
    fallback: str | None = Field(default=None, description="Why NWOR fell back, if it did.")


class StepReply(Contract):
    epoch: int
    step_id: int
    scheduled: list[Scheduled]
    refused: list[Refused]
    table_updates: list[TableUpdate]
    slot_mapping: list[int] = Field(description="int64 slot per token of the step; -1: skip.")
    committed: CommitSummary
    free_blocks: int


# ---------------------------------------------------------------- inspection


class RequestRef(Contract):
    worker_id: WorkerId
    req_id: ReqId


class RequestState(Contract):
    worker_id: str
    req_id: str
    row: int
    capacity: int
    history: int
    pending_overlap_slack: int
    pending_draft_len: int | None
    num_blocks: int
    block_ids: list[int]


class PoolQuery(Contract):
    verify: bool = Field(default=False, description="Also run check_invariants (O(pool)).")


class WorkerState(Contract):
    worker_id: str
    num_requests: int
    last_step_id: int | None
    lease_expires_in_s: float


class PoolState(Contract):
    epoch: int
    layout: PoolLayout
    free_blocks: int
    used_blocks: int
    num_requests: int
    workers: list[WorkerState]
    capacity_tokens: int
    history_tokens: int
    pending_slack_tokens: int
    leases_expired: int
    counters: dict[str, int]
    invariants: Literal["ok", "unchecked"]


class Health(Contract):
    status: Literal["ok"]


class Readiness(Contract):
    status: Literal["ready"]
    epoch: int
