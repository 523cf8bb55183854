"""Tools for running and testing a service: `kvalloc loadgen` and the process launcher that tests,
benchmarks and docs use to start a real `kvalloc serve`."""
