"""kvalloc's library: paged KV pool, block tables, overlap-slack capacity accounting, NWOR.

``from kvalloc.allocator import X`` imports X's module when X is first asked for (PEP 562), not
every module at once: what needs only the light parts (`PoolConfig`, the errors, the KV event
types, `allocator.commands`) loads no torch, numba or Triton, so that ``kvalloc serve --help``
answers at once. `_EXPORTS` names each name's module.
"""

from __future__ import annotations

import importlib
from typing import Any

# module (under kvalloc.allocator) -> the names the library's users import from it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "capacity.block_pool": ("BlockPool",),
    "capacity.block_table": ("BlockTable", "DeviceCopy"),
    "capacity.host_tier": ("HostTier", "TierCounters"),
    "capacity.kv_events": (
        "AllBlocksCleared", "BlockRemoved", "BlockStored", "HashScope", "KVCacheEvent",
        "KVEventBatch", "NamespacedEvent", "WireShape", "encode_batch", "event_encoder",
        "namespace_digest", "router_hashes"),
    "capacity.manager": ("KVCacheManager",),
    "capacity.prefix_cache": ("Prompt", "block_hashes"),
    "capacity.slots": ("padded_slot_mapping", "slot_mapping"),
    "capacity.step.plan": (
        "ADMITTED", "REFUSED_BATCH_FULL", "REFUSED_ONBOARDING", "REFUSED_OUT_OF_BLOCKS",
        "PlanArrays", "RequestView", "StepOutcome",
        "StepPlan", "checked_plan", "compiled_type"),
    "capacity.table_validator": ("TableValidator",),
    "capacity.windows.groups": ("GroupSpec", "GroupsOutcome", "KVCacheGroups",
                                "group_tensor_name"),
    "capacity.windows.layers": ("LayerGroup", "group_pools"),
    "capacity.tier_copies": ("NO_COPIES", "TierCopies"),
    "common.placement": ("TensorAllocator", "plain_tensor"),
    "config": ("KVDType", "KVLayout", "PoolConfig", "SlackPolicy", "shard_span"),
    "errors": (
        "AcceptedExceedsDrafts", "BatchFull", "BlockTableOverflow", "DraftLenExceeded",
        "DuplicateRequest", "GrantPending", "InvalidScvMode", "InvalidValue", "InvariantViolation",
        "KVAllocError", "NoPendingGrant", "NworError", "NworInputError", "OnboardingPending",
        "OutOfBlocks", "PrefillIncomplete", "SlotDtypeError", "StagingOverflow", "UnknownRequest",
        "WindowStateError"),
    "metrics": ("AllocatorMetrics",),
    "nwor.acceptance": (
        "SCV_MODE_ENV", "ScvAcceptor", "ScvMode", "ScvStats", "accept", "acceptance_mask",
        "scv_mode_from_env"),
    "nwor.commit_kernel": ("resolve_backend", "write_staged"),
    "nwor.deferred_writes": ("DeferredWriteManager",),
    "nwor.fence": ("CLOSED", "FenceWords", "WriterFence"),
    "nwor.packed_commit": ("PackedCommit", "commit_packed"),
    "nwor.storage": ("KVStorage",),
    "nwor.two_source_attention": ("merge_attention", "paged_attention", "two_source_attention"),
    "nwor.window": ("NworMetrics", "WindowLayout", "WindowStats"),
}
_HOMES = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
