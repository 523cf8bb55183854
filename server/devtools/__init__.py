"""Tools for running and testing a service: `kvalloc loadgen` and the workers it simulates
(`simulated_worker`, and `overlap_worker` one step ahead), the process launcher that tests,
benchmarks and docs use to start a real `kvalloc serve`, and a KV event subscriber that follows a
service's prefix cache as a router does (the soak's)."""
