"""Command-line tools over the library: `kvalloc simulate` (both crashes reproduced on purpose,
the shared-prefix workload, the plot) and what the commands share: the argument parsers, and
Ctrl-C taken at a step boundary (`interrupt`)."""
