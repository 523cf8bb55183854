"""The service contract: one pydantic model per operation's input and reply.

REST validates bodies with these models and generates its OpenAPI document from them;
`server.contract.wire` derives the msgspec structs that the IPC transport, the service core and the
client use from these same classes, so the two transports cannot drift apart. Every constraint is
declared once, through `_constrained`, in the vocabulary both libraries read (pydantic's ``Field``
and msgspec's ``Meta`` take the same keywords).

Request ids live in their worker's namespace: two workers may both have a request ``"r1"``, and a
worker can neither see nor touch another worker's requests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from kvalloc.allocator import KVLayout
from pydantic import BaseModel, ConfigDict, Field, model_validator

INT32_MAX = 2**31 - 1
INT63_MAX = 2**63 - 1


def _constrained(base: type, **limits: Any) -> Any:
    """``base`` with ``limits`` that both pydantic and msgspec enforce.

    A pattern's final ``$`` means the end of the text to pydantic (Rust regex) but "the end, or
    before a final newline" to msgspec (Python's re): msgspec gets ``\\Z`` instead, so ``"x\\n"``
    is refused on both transports alike.
    """
    meta = dict(limits)
    if meta.get("pattern", "").endswith("$"):
        meta["pattern"] = meta["pattern"][:-1] + r"\Z"
    return Annotated[base, Field(**limits), msgspec.Meta(**meta)]


# Worker ids name shared-memory segments too, hence the conservative alphabet.
WORKER_ID_LIMITS: dict[str, Any] = {"min_length": 1, "max_length": 64,
                                    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$"}
REQ_ID_LIMITS: dict[str, Any] = {"min_length": 1, "max_length": 256}

WorkerId = _constrained(str, **WORKER_ID_LIMITS)
ReqId = _constrained(str, **REQ_ID_LIMITS)
Count = _constrained(int, ge=0, le=INT32_MAX)
Positive = _constrained(int, ge=1, le=INT32_MAX)
Serial = _constrained(int, ge=0, le=INT63_MAX)


# No message nests deeper than this (a step's columns: object, object, list); deeper input is
# left as it is for validation to refuse, and never recursed into.
_NESTING = 8


def integral_as_int(value: Any, depth: int = 0) -> Any:
    """Parsed JSON ``value`` with every float that has no fractional part (``733.0``) made an
    int, in lists and objects down to `_NESTING` levels. JSON Schema counts such a number as an
    integer, so a body the document accepts may carry one; pydantic's and msgspec's strict ints
    take only integer literals. A float field takes the int back as a float; ``"7"`` and ``7.5``
    stay as they are, and are refused where an integer is due."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if depth >= _NESTING:
        return value
    if isinstance(value, list):
        return [integral_as_int(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: integral_as_int(v, depth + 1) for k, v in value.items()}
    return value


class Contract(BaseModel):
    """Base of every message: unknown fields are an error, messages are values, and types are
    strict (``"7"`` is not an int), as msgspec is, so both transports accept the same bodies.
    A number without a fractional part is an integer, as JSON Schema says (`integral_as_int`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        return integral_as_int(data) if isinstance(data, dict) else data


# ---------------------------------------------------------------- errors


class ErrorBody(Contract):
    """Every error, on both transports. ``field`` names the input at fault (dotted path)."""

    status: int = Field(description="HTTP status; the IPC transport sends the same number.")
    code: str = Field(description="Stable machine-readable error code, e.g. 'stale_epoch'.")
    field: str = Field(description="The input at fault, e.g. 'grants[3].draft_len'.")
    message: str


# ---------------------------------------------------------------- registration and attach


class RegisterRequest(Contract):
    """Register a worker and open a session. An id held by another live session is refused
    unless ``replace`` is set (a restarted worker taking its place back): its requests are then
    freed and its session ends, so a zombie of the old process can no longer act."""

    worker_id: WorkerId
    attached: bool = Field(
        default=True, description="The worker maps the pool and block table (same host); "
                                  "false: every reply carries table deltas and slot mappings.")
    replace: bool = Field(default=False, description="Take over the id from a live session.")
    nonce: Serial | None = Field(
        default=None, description="A random number the client draws per registration and "
                                  "sends again when it retries it: the same request with the "
                                  "nonce of the id's live session, before that session's first "
                                  "step, is answered that session's registration again, "
                                  "changing nothing.")
    overlap: bool = Field(
        default=False, description="The worker's steps run at lag 2: a step may grant a request "
                                   "whose previous step is unsettled, results settle each "
                                   "request's oldest unsettled step one call later, and the "
                                   "worker commits its own accepted tokens on its device, "
                                   "fenced by its session's fence word and, with prefix "
                                   "caching, refusing the cached blocks the attachment's "
                                   "protected mask marks. The service commits nothing for it "
                                   "(committed is 0, 0, null) and sends it no slot_mapping.")
    own_table: bool = Field(
        default=False, description="An attached worker asks to keep its own device copy of "
                                   "the block table: every reply then carries its table "
                                   "deltas (tables), which it applies on its own stream "
                                   "before its next forward, and the service no longer "
                                   "uploads its rows. Granted (Registration.own_table) for a "
                                   "pool of one block table on one CUDA device; an overlap "
                                   "worker's calls then cost the device nothing (no step "
                                   "fence) on a service of one worker (max_workers 1) "
                                   "without prefix caching.")
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="The worker's data-parallel rank: a service that "
                                        "allocates for another rank refuses it (409 "
                                        "wrong_rank); none: any.")


class WorkerRef(Contract):
    worker_id: WorkerId
    session: Serial


class ShmRef(Contract):
    """A POSIX shared-memory segment (mode 0600) under /dev/shm (or KVALLOC_SHM_DIR)."""

    name: str = Field(description="Segment name; the file is /dev/shm/<name> (or under "
                                  "KVALLOC_SHM_DIR where the service and worker set it).")
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


class PoolHandles(Contract):
    """The handles of one pool's tensors and its fence (`Attachment` says what each holds)."""

    kv: TensorHandle
    block_table: TensorHandle
    staging: TensorHandle
    forward_done: EventHandle | None = None
    commit_done: EventHandle | None = None
    protected: TensorHandle | None = None
    writer_fence: TensorHandle | None = None


class Attachment(PoolHandles):
    """What a same-host worker maps: the pool, the block table and its own staging buffer.

    ``kv`` is ``[num_layers, P, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` with P
    planes (`PoolLayout.kv_layout`): "kv" has K at index 0, V at 1; "latent" has one plane, one
    head, the MLA latent of ``head_dim``; ``block_table`` is int32 ``[max_batch_size,
    max_blocks_per_seq]``, -1 past a request's blocks (-2 in the leading columns whose blocks a
    windowed pool gave back, `PoolLayout.window`); ``staging`` is ``[num_layers, P,
    max_step_tokens, num_kv_heads, head_dim]``: the worker writes token i of a step
    (``slot_mapping[i]``) at ``staging[layer, plane, i]``.
    On CUDA the worker records ``forward_done`` after its forward and waits on ``commit_done``
    before its next forward; on CPU both are absent, and so they are for the overlap worker of a
    service of one worker that keeps its own table (`RegisterRequest.own_table`), on whose calls
    the service does no device work. ``protected`` (a service with prefix
    caching) is bool ``[num_blocks]``, True for a cached prefix block that other requests read:
    a worker that commits its own tokens must not write those blocks. ``writer_fence`` is int64
    ``[1]``, the session's fence word: it holds the registration's ``session`` while the session
    is open and -1 from the moment it ends (before its blocks are freed); a worker that commits
    its own tokens passes it to every write, which reads it on the device and writes nothing
    once it has changed.
    """

    shards: list[ShardAttachment] = Field(
        default_factory=list, description="A tensor-parallel service's shards, in shard order "
                                          "(shard 0's tensors are the fields above); empty for "
                                          "a service of one pool.")
    groups: list[GroupAttachment] = Field(
        default_factory=list, description="A grouped pool's groups (`PoolLayout.groups`), in "
                                          "group order (group 0's tensors are the fields "
                                          "above); empty for a pool of one group of every "
                                          "layer.")


class GroupAttachment(PoolHandles):
    """One group of a grouped pool, as `Attachment` describes the pool: its ``kv`` and
    ``staging`` hold the model layers ``layers`` (in that order: the group's layer ``i`` is the
    model's ``layers[i]``), its ``block_table`` is the group's own (a row is the same request in
    every group, its columns the group's blocks), and ``window`` is the group's sliding window
    (None: full attention). ``protected`` (a service with prefix caching) is the group's own,
    bool ``[its num_blocks]``: each group caches its own blocks. The step fence and the writer
    fence are the pool's (the fields of `Attachment`): the groups share one device."""

    name: str
    layers: list[int]
    window: int | None = None


class ShardAttachment(PoolHandles):
    """One tensor-parallel shard of the pool, as `Attachment` describes the pool: its ``kv`` and
    ``staging`` hold KV heads ``head_start .. head_stop`` of the model (``head_stop -
    head_start`` heads), and its ``block_table`` is a copy of the one table on the shard's
    ``device``; its fence orders the worker's rank on that device with the service."""

    device: str
    head_start: int
    head_stop: int


class PoolLayout(Contract):
    num_blocks: int
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: KVLayout = Field(default="kv", description="kv: K and V per head (2 planes); "
                                                          "latent: one MLA latent per token "
                                                          "and layer (1 plane, 1 head of "
                                                          "head_dim), no V.")
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
    tensor_parallel: int = Field(default=1, description="Shards the pool is split into by KV "
                                                        "heads (`Attachment.shards`); "
                                                        "num_kv_heads counts them all.")
    data_parallel_rank: int | None = Field(default=None, description="The data-parallel rank "
                                                                     "the service allocates "
                                                                     "for, if it was given one.")
    window: int | None = Field(
        default=None, description="The sliding window in tokens a windowed pool gives back the "
                                  "blocks behind (their block-table entries then hold -2): a "
                                  "worker may serve it only a model whose every layer reads "
                                  "no further back. None: full attention, nothing given back.")
    groups: list[GroupLayout] = Field(
        default_factory=list, description="A pool of several groups of layers (a model that "
                                          "mixes full and windowed layers), each with its own "
                                          "blocks, block table and window "
                                          "(`Attachment.groups`); num_blocks and window above "
                                          "are then group 0's. Empty: one group of every "
                                          "layer.")


class GroupLayout(Contract):
    """One group of a grouped pool: the model layers it holds, their window, its blocks."""

    name: str
    layers: list[int]
    window: int | None = None
    num_blocks: int


class Registration(Contract):
    worker_id: str
    session: int = Field(description="This registration's session; send it with every call. "
                                     "A call with an ended session is refused (stale_session).")
    epoch: int = Field(description="The service's epoch; send it with every step.")
    lease_ttl_s: float = Field(description="A worker silent this long loses its requests.")
    next_step_id: int = Field(description="Step ids start here and only increase.")
    layout: PoolLayout
    attachment: Attachment
    own_table: bool = Field(
        default=False, description="The worker keeps its own device copy of the block table "
                                   "from every reply's tables (RegisterRequest.own_table, "
                                   "granted); false: it reads the attachment's block_table.")


class Deregistered(Contract):
    worker_id: str
    freed_requests: int


# ---------------------------------------------------------------- the per-step call


class Column:
    """Marks a list of integers as a column of the step messages. REST carries it as a JSON list;
    IPC packs every column of a message into one buffer of little-endian int64
    (`server.contract.wire`), so a batch costs no Python object per element on the hot transport.
    ``ge`` / ``le`` bound every element on both transports."""

    def __init__(self, ge: int, le: int) -> None:
        self.ge, self.le = ge, le

    def __repr__(self) -> str:
        return f"Column(ge={self.ge}, le={self.le})"


def _column(ge: int, le: int, description: str) -> Any:
    return Annotated[list[_constrained(int, ge=ge, le=le)], Column(ge, le),
                     Field(default_factory=list, description=description)]


HANDLE_LIMIT = INT63_MAX
Handles = _column(0, HANDLE_LIMIT, "Request handles, as `admitted` returned them.")


class ResultColumns(Contract):
    """The previous step's accepted draft counts: the next call commits those tokens and settles
    the grant (rewinds rejected drafts, reclaims the overlap slack). An overlap worker's settle
    each request's oldest unsettled step, which it committed itself."""

    handles: Handles
    num_accepted: _column(0, INT32_MAX, "Accepted drafts, one per handle.")


class HandleColumn(Contract):
    handles: Handles


class GrantColumns(Contract):
    """Generation grants for this step: 1 + draft_len tokens each (+ overlap slack)."""

    handles: Handles
    draft_lens: _column(0, INT32_MAX, "Drafts of each grant.")


class PaddingColumns(Contract):
    """CUDA-graph padding: run a grant with ``padded_draft_lens`` drafts."""

    handles: Handles
    padded_draft_lens: _column(0, INT32_MAX, "Padded draft count, >= the grant's draft_len.")


class PrefillColumns(Contract):
    """Further chunks of prompts being prefilled."""

    handles: Handles
    num_tokens: _column(1, INT32_MAX, "Prompt tokens of the chunk.")


class NewColumns(Contract):
    """Requests admitted by this step. The only place a request's id travels: the reply's
    ``admitted`` gives each its handle."""

    req_ids: list[ReqId] = Field(default_factory=list)
    prompt_lens: _column(1, INT32_MAX, "Prompt length of each new request.")
    first_chunks: _column(0, INT32_MAX, "Prompt tokens scheduled now (0: the whole prompt); "
                                        "empty: every prompt whole. With a cached prefix they "
                                        "count from its end.")
    prompt_token_ids: _column(0, INT32_MAX, "Every new request's prompt token ids, "
                                            "concatenated (sum of prompt_lens values); empty: "
                                            "no sharing. With prefix caching on, a request "
                                            "reuses the cached blocks of its longest cached "
                                            "prefix.")


class StepRequest(Contract):
    """One scheduler step. Applied atomically, in this order: reverts, results, finished, grants
    and padding, prefill, new. Every decode request of the previous step must appear in exactly
    one of ``results``, ``reverts`` or ``finished``; for an overlap worker (lag 2), of the step
    before it, and a revert undoes a request's newest unsettled step.

    ``step_id`` must exceed the last applied one; repeating the last one returns its reply again
    without applying anything.

    Rules between columns, which JSON Schema cannot state (no keyword makes two arrays equally
    long), each answered 422 ``invalid_body`` naming the column: ``num_accepted``,
    ``draft_lens``, ``padded_draft_lens`` and ``num_tokens`` have one value per ``handles`` of
    their group; ``new.prompt_lens`` one per ``new.req_ids``; ``new.first_chunks`` none or one per
    ``new.req_ids``; ``new.prompt_token_ids`` none or ``sum(new.prompt_lens)`` ids. So are the
    rules of the allocator's state: a handle must be a live request of the session, a result
    accepts at most the drafts granted.
    """

    worker_id: WorkerId
    session: Serial = Field(description="The session `register` returned.")
    epoch: Serial
    step_id: Serial
    results: ResultColumns = Field(default_factory=ResultColumns)
    reverts: HandleColumn = Field(default_factory=HandleColumn)
    finished: HandleColumn = Field(default_factory=HandleColumn)
    grants: GrantColumns = Field(default_factory=GrantColumns)
    padding: PaddingColumns = Field(default_factory=PaddingColumns)
    prefill: PrefillColumns = Field(default_factory=PrefillColumns)
    new: NewColumns = Field(default_factory=NewColumns)


class ScheduledColumns(Contract):
    """This step's forward, in token order: granted decodes (in grant order), then granted
    prefill chunks, then admitted new requests. Request ``i`` owns tokens ``token_offsets[i] ..
    + num_tokens[i]`` of the step at positions ``start_positions[i] ..``; its last
    ``num_drafts[i]`` tokens are drafts. ``rows`` index the block table."""

    handles: Handles
    rows: _column(0, INT32_MAX, "Block-table row of each request.")
    token_offsets: _column(0, INT32_MAX, "First token of each request in the step.")
    num_tokens: _column(1, INT32_MAX, "Tokens of each request in the step.")
    num_drafts: _column(0, INT32_MAX, "Drafts among them (the last ones).")
    start_positions: _column(0, INT32_MAX, "Sequence position of each request's first token.")


REFUSED_KINDS = {0: "grant", 1: "prefill", 2: "new"}
REFUSAL_REASONS = {1: "out_of_blocks", 2: "batch_full", 3: "onboarding"}


class RefusedColumns(Contract):
    """Not scheduled this step; nothing changed for them, so the scheduler can preempt or retry.
    ``kinds``: 0 grant, 1 prefill chunk, 2 new request; ``indices``: position in that list of the
    request; ``reasons``: 1 out of blocks, 2 every block-table row in use, 3 its cached prefix is
    being copied back from the host tier (a new request only; asked again, it is admitted once
    the copies are done)."""

    kinds: _column(0, 2, "0 grant, 1 prefill, 2 new.")
    indices: _column(0, INT32_MAX, "Index into the request's list of that kind.")
    reasons: _column(1, 3, "1 out_of_blocks, 2 batch_full, 3 onboarding (a new request whose "
                           "prefix the host tier is copying back: ask again).")


class TableDeltas(Contract):
    """Block-table changes, for workers that did not map the block table: for each ``i``,
    ``table[rows[i], starts[i]:num_blocks[i]]`` = the next ``num_blocks[i] - starts[i]`` ids of
    ``block_ids`` and ``table[rows[i], num_blocks[i]:] = -1`` (a freed row has 0 blocks)."""

    rows: _column(0, INT32_MAX, "Rows that changed.")
    starts: _column(0, INT32_MAX, "First changed column of each row.")
    num_blocks: _column(0, INT32_MAX, "Each row's block count after the step.")
    block_ids: _column(-2, INT32_MAX, "The new ids, row after row; -2 in a column whose block "
                                      "a windowed pool gave back (`PoolLayout.window`).")


class CommitSummary(Contract):
    """What the service's commit of the previous step wrote into the pool: nothing for an
    overlap worker, which commits its own tokens."""

    tokens: int = Field(description="Tokens the previous step staged (0: overlap worker).")
    written: int = Field(description="Tokens the service wrote into the pool.")
    fallback: str | None = Field(default=None, description="Why NWOR fell back, if it did.")


class StepReply(Contract):
    epoch: int
    step_id: int
    admitted: _column(-1, HANDLE_LIMIT, "Per new request: its handle, or -1 when refused.")
    scheduled: ScheduledColumns
    refused: RefusedColumns
    committed: CommitSummary
    free_blocks: int
    tables: TableDeltas | None = Field(
        default=None, description="Only for workers that keep their own block table "
                                   "(Registration.own_table).")
    slot_mapping: _column(-1, INT63_MAX, "Only for workers that keep their own block table: the "
                                         "pool slot of each token of the step; -1: skip. Empty "
                                         "for an overlap worker (it computes its slots).")
    cached_tokens: _column(0, INT32_MAX, "Per new request: prompt tokens already in the pool "
                                         "(a cached prefix; its scheduled prefill starts after "
                                         "them), 0 when refused.")


# ---------------------------------------------------------------- inspection


class RequestRef(Contract):
    """A request, read by the session that owns it: a request's blocks and history are its
    worker's, so another token holder who knows the worker id does not read them."""

    worker_id: WorkerId
    session: Serial
    req_id: ReqId


class RequestState(Contract):
    worker_id: str
    req_id: str
    handle: int
    row: int
    capacity: int
    history: int
    pending_overlap_slack: int
    pending_draft_len: int | None
    num_blocks: int
    block_ids: list[int] = Field(description="The row's first num_blocks columns: block ids, "
                                             "-2 where a windowed pool gave the block back.")


class PoolQuery(Contract):
    verify: bool = Field(default=False, description="Also put back any shared state another "
                                                    "process changed (block table, protection, "
                                                    "fence words) from the service's own, then "
                                                    "run check_invariants (O(pool)).")


class WorkerState(Contract):
    worker_id: str
    num_requests: int
    last_step_id: int | None
    lease_expires_in_s: float


class PoolState(Contract):
    """The pool's blocks: ``free_blocks + used_blocks + parked_blocks`` is all of them, counted
    as ``/metrics`` counts them."""

    epoch: int
    layout: PoolLayout
    free_blocks: int
    used_blocks: int = Field(description="Blocks live requests hold.")
    parked_blocks: int = Field(description="Cached blocks no request holds (prefix caching): "
                                           "reusable until evicted, room for new requests.")
    num_requests: int
    workers: list[WorkerState]
    capacity_tokens: int
    history_tokens: int
    pending_slack_tokens: int
    leases_expired: int
    counters: dict[str, int]
    # "repaired": verify found shared state another process had changed, put it back, and
    # every invariant then held.
    invariants: Literal["ok", "repaired", "unchecked"]


class Health(Contract):
    status: Literal["ok"]


class Readiness(Contract):
    status: Literal["ready"]
    epoch: int
