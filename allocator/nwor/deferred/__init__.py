"""The parts `DeferredWriteManager` (`allocator.nwor.deferred_writes`) coordinates, each the one
owner of its data and the place its invariants are stated and checked:

- `input_checks`: `StagingSpec`, what a manager was built for, and the checks of what callers
  hand it;
- `fp8_scales`: the dtype an fp8 pool stages in, and the scales its commit quantises with;
- `protection`: the guard that keeps every write out of protected blocks;
- `staging`: the window's staged K/V and slot rows, or the caller's buffer and host slots;
- `device_keep`: the tables the device keep mask reads, and the mask;
- `counters`: what the closed windows did, counted on the host or on the device;
- `graphs`: the captured commit, verify and host-write graphs;
- `capture`: `GraphCapture` (``mgr.graphs``), how a caller captures them ahead of its windows;
- `pool_writes`: every way a window's tokens reach the pool, the fallback included.

Part of `allocator.nwor`: never imports `allocator.capacity`.
"""
