"""Command-line tools over the library: `kvalloc simulate` (both crashes reproduced on purpose,
the shared-prefix workload, the plot) and the argument parsers the commands share."""
