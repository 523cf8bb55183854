"""Capacity: who holds which block. Host-only accounting (grants, settles, slack), the block pool
and table, the prefix cache and `KVCacheManager`, whose every call is one batched step
(`capacity.step`). Never imports `allocator.nwor`: it decides where KV may go, not what is
written there."""
