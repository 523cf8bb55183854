"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR."""

from .acceptance import (
    SCV_MODE_ENV,
    ScvAcceptor,
    ScvMode,
    ScvStats,
    acceptance_mask,
    scv_mode_from_env,
)
from .attention import merge_attention, paged_attention, two_source_attention
from .block_pool import BlockPool
from .block_table import BlockTable
from .commit_kernel import write_staged
from .config import PoolConfig, SlackPolicy
from .deferred_writes import DeferredWriteManager
from .errors import (
    AcceptedExceedsDrafts,
    BatchFull,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidValue,
    InvariantViolation,
    KVAllocError,
    NoPendingGrant,
    OutOfBlocks,
    PrefillIncomplete,
    UnknownRequest,
)
from .kv_storage import KVStorage
from .manager import KVCacheManager
from .nwor_errors import (
    InvalidScvMode,
    NworError,
    NworInputError,
    SlotDtypeError,
    StagingOverflow,
    WindowStateError,
)
from .nwor_window import NworMetrics, WindowLayout, WindowStats
from .placement import TensorAllocator, plain_tensor
from .step_plan import (
    ADMITTED,
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    RequestView,
    StepOutcome,
    StepPlan,
)

__all__ = [
    "ADMITTED",
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
    "acceptance_mask",
    "merge_attention",
    "paged_attention",
    "plain_tensor",
    "scv_mode_from_env",
    "two_source_attention",
    "write_staged",
]
