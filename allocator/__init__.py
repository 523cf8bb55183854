"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR."""

from allocator.capacity.block_pool import BlockPool
from allocator.capacity.block_table import BlockTable
from allocator.capacity.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    external_hash,
)
from allocator.capacity.manager import KVCacheManager
from allocator.capacity.prefix_cache import Prompt, block_hashes
from allocator.capacity.slots import padded_slot_mapping, slot_mapping
from allocator.capacity.step.plan import (
    ADMITTED,
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    RequestView,
    StepOutcome,
    StepPlan,
    checked_plan,
    compiled_type,
)
from allocator.capacity.table_validator import TableValidator
from allocator.common.placement import TensorAllocator, plain_tensor
from allocator.config import KVDType, PoolConfig, SlackPolicy, shard_span
from allocator.errors import (
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
from allocator.metrics import AllocatorMetrics
from allocator.nwor.acceptance import (
    SCV_MODE_ENV,
    ScvAcceptor,
    ScvMode,
    ScvStats,
    accept,
    acceptance_mask,
    scv_mode_from_env,
)
from allocator.nwor.commit_kernel import resolve_backend, write_staged
from allocator.nwor.deferred_writes import DeferredWriteManager
from allocator.nwor.fence import CLOSED, FenceWords, WriterFence
from allocator.nwor.packed_commit import PackedCommit, commit_packed
from allocator.nwor.storage import KVStorage
from allocator.nwor.two_source_attention import (
    merge_attention,
    paged_attention,
    two_source_attention,
)
from allocator.nwor.window import NworMetrics, WindowLayout, WindowStats

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
    "InvalidScvMode",
    "InvalidValue",
    "InvariantViolation",
    "KVAllocError",
    "KVCacheEvent",
    "KVCacheManager",
    "KVDType",
    "KVEventBatch",
    "KVStorage",
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
    "WriterFence",
    "accept",
    "acceptance_mask",
    "block_hashes",
    "checked_plan",
    "commit_packed",
    "compiled_type",
    "external_hash",
    "merge_attention",
    "padded_slot_mapping",
    "paged_attention",
    "plain_tensor",
    "resolve_backend",
    "scv_mode_from_env",
    "shard_span",
    "slot_mapping",
    "two_source_attention",
    "write_staged",
]
