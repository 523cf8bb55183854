"""The parts `DeferredWriteManager` (`allocator.nwor.deferred_writes`) coordinates, each the one
owner of its data:

- `fp8_scales`: the dtype an fp8 pool stages in, and the scales its commit quantises with.
"""
