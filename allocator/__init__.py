"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR."""

from allocator.capacity.block_pool import BlockPool
from allocator.capacity.block_table import BlockTable
from allocator.capacity.manager import KVCacheManager
from allocator.capacity.step.plan import (
    ADMITTED,
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    RequestView,
    StepOutcome,
    StepPlan,
)
from allocator.common.placement import TensorAllocator, plain_tensor
from allocator.config import PoolConfig, SlackPolicy
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
from allocator.nwor.acceptance import (
    SCV_MODE_ENV,
    ScvAcceptor,
    ScvMode,
    ScvStats,
    accept,
    acceptance_mask,
    scv_mode_from_env,
)
from allocator.nwor.commit_kernel import write_staged
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
    "BatchFull",
    "BlockPool",
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
    "KVCacheManager",
    "KVStorage",
    "NoPendingGrant",
    "NworError",
    "NworInputError",
    "NworMetrics",
    "OutOfBlocks",
    "PackedCommit",
    "PoolConfig",
    "PrefillIncomplete",
    "RequestView",
    "ScvAcceptor",
    "ScvMode",
    "ScvStats",
    "SlackPolicy",
    "SlotDtypeError",
    "StagingOverflow",
    "StepOutcome",
    "StepPlan",
    "TensorAllocator",
    "UnknownRequest",
    "WindowLayout",
    "WindowStateError",
    "WindowStats",
    "WriterFence",
    "accept",
    "acceptance_mask",
    "commit_packed",
    "merge_attention",
    "paged_attention",
    "plain_tensor",
    "scv_mode_from_env",
    "two_source_attention",
    "write_staged",
]
