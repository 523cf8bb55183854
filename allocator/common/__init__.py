"""What both wings of the allocator use: the numba switch, whether Triton is installed, pinned
host-to-device uploads, the CUDA-graph cache they replay from, and where tensors are allocated.
Imports nothing else of the allocator but its config and errors."""
