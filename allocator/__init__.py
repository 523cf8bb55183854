"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR."""

from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.block_table import BlockTable
from kvalloc.allocator.capacity.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashScope,
    KVCacheEvent,
    KVEventBatch,
    NamespacedEvent,
    WireShape,
    encode_batch,
    namespace_digest,
    router_hashes,
)
from kvalloc.allocator.capacity.manager import KVCacheManager
from kvalloc.allocator.capacity.prefix_cache import Prompt, block_hashes
from kvalloc.allocator.capacity.slots import padded_slot_mapping, slot_mapping
from kvalloc.allocator.capacity.step.plan import (
    ADMITTED,
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    RequestView,
    StepOutcome,
    StepPlan,
    checked_plan,
    compiled_type,
)
from kvalloc.allocator.capacity.table_validator import TableValidator
from kvalloc.allocator.common.placement import TensorAllocator, plain_tensor
from kvalloc.allocator.config import KVDType, PoolConfig, SlackPolicy, shard_span
from kvalloc.allocator.errors import (
    AcceptedExceedsDrafts,
    BatchFull,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidScvMode,
    InvalidValue,
    InvariantViolation,
    KVAllocError,
    NoPendingGrant,
    NworError,
    NworInputError,
    OutOfBlocks,
    PrefillIncomplete,
    SlotDtypeError,
    StagingOverflow,
    UnknownRequest,
    WindowStateError,
)
from kvalloc.allocator.metrics import AllocatorMetrics
from kvalloc.allocator.nwor.acceptance import (
    SCV_MODE_ENV,
    ScvAcceptor,
    ScvMode,
    ScvStats,
    accept,
    acceptance_mask,
    scv_mode_from_env,
)
from kvalloc.allocator.nwor.commit_kernel import resolve_backend, write_staged
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.fence import CLOSED, FenceWords, WriterFence
from kvalloc.allocator.nwor.packed_commit import PackedCommit, commit_packed
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.two_source_attention import (
    merge_attention,
    paged_attention,
    two_source_attention,
)
from kvalloc.allocator.nwor.window import NworMetrics, WindowLayout, WindowStats

__all__ = [
    "ADMITTED",
    "CLOSED",
    "REFUSED_BATCH_FULL",
    "REFUSED_OUT_OF_BLOCKS",
    "SCV_MODE_ENV",
    "AcceptedExceedsDrafts",
    "AllBlocksCleared",
    "AllocatorMetrics",
    "BatchFull",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "BlockTableOverflow",
    "DeferredWriteManager",
    "DraftLenExceeded",
    "DuplicateRequest",
    "FenceWords",
    "GrantPending",
    "HashScope",
    "InvalidScvMode",
    "InvalidValue",
    "InvariantViolation",
    "KVAllocError",
    "KVCacheEvent",
    "KVCacheManager",
    "KVDType",
    "KVEventBatch",
    "KVStorage",
    "NamespacedEvent",
    "NoPendingGrant",
    "NworError",
    "NworInputError",
    "NworMetrics",
    "OutOfBlocks",
    "PackedCommit",
    "PoolConfig",
    "PrefillIncomplete",
    "Prompt",
    "RequestView",
    "ScvAcceptor",
    "ScvMode",
    "ScvStats",
    "SlackPolicy",
    "SlotDtypeError",
    "StagingOverflow",
    "StepOutcome",
    "StepPlan",
    "TableValidator",
    "TensorAllocator",
    "UnknownRequest",
    "WindowLayout",
    "WindowStateError",
    "WindowStats",
    "WireShape",
    "WriterFence",
    "accept",
    "acceptance_mask",
    "block_hashes",
    "checked_plan",
    "commit_packed",
    "compiled_type",
    "encode_batch",
    "merge_attention",
    "namespace_digest",
    "padded_slot_mapping",
    "paged_attention",
    "plain_tensor",
    "resolve_backend",
    "router_hashes",
    "scv_mode_from_env",
    "shard_span",
    "slot_mapping",
    "two_source_attention",
    "write_staged",
]
