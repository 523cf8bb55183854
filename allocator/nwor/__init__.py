"""NWOR and SCV: what reaches the pool. The staging window and its arithmetic, the keep mask, the
fused commit kernel, acceptance masks, `DeferredWriteManager` (its parts in `deferred/`), and
the two-source attention reference. Never imports `allocator.capacity`: it writes where it is
told, and is told by slots."""
