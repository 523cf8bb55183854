"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR."""

from .block_pool import BlockPool
from .block_table import BlockTable
from .config import PoolConfig, SlackPolicy
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
from .manager import KVCacheManager, StepOutcome, StepPlan

__all__ = [
    "AcceptedExceedsDrafts",
    "BatchFull",
    "BlockPool",
    "BlockTable",
    "BlockTableOverflow",
    "DraftLenExceeded",
    "DuplicateRequest",
    "GrantPending",
    "InvalidValue",
    "InvariantViolation",
    "KVAllocError",
    "KVCacheManager",
    "KVStorage",
    "NoPendingGrant",
    "OutOfBlocks",
    "PoolConfig",
    "PrefillIncomplete",
    "SlackPolicy",
    "StepOutcome",
    "StepPlan",
    "UnknownRequest",
]
