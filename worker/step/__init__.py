"""One scheduler step on the device: `device_step` (its forward, greedy verification and an
overlap worker's commit, launched without reading anything back), `step_metadata` (+ its Triton
kernel: input ids, positions, slots) and `rows` (each block-table row's state between steps). An
overlap worker's own NWOR commit is the library's (`allocator.PackedCommit`).

May import `allocator`, `server` (the attached pool's types) and `worker.attention`.
"""
