"""One scheduler step on the device: `device_step` (its forward, greedy verification and an
overlap worker's commit, launched without reading anything back), `step_metadata` (input ids,
positions, slots: the torch reference and the launch of its kernel in
`worker.kernels.step_metadata`), `rows` (each block-table row's state between steps),
`batch_buckets` (the batch sizes a decode step grows to), `decode_graphs` (the decode steps'
CUDA graphs) and `pool_groups` (the attached pool's groups of layers, each read through its own
block table; one group for a pool of every layer). An overlap worker's own NWOR commit is
the library's (`allocator.PackedCommit`).

May import `allocator`, `server` (the attached pool's types), `worker.attention` and
`worker.kernels`.
"""
