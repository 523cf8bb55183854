"""Command-line tools over the library: `kvalloc simulate` (both crashes reproduced on purpose,
the shared-prefix workload, the plot). What the commands share is `allocator.commands`. Nothing
outside this room imports it: the ``kvalloc`` dispatcher (`server.cli`) runs `simulate` by
name."""
