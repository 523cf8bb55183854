"""The model's gated MLPs in two GEMMs and one launch between them: `silu_and_mul` (the
arithmetic of transformers' ``act_fn(gate_proj(x)) * up_proj(x)`` in plain torch, the
reference), its Triton launch `silu_and_mul_triton` with the kernel in
`worker.kernels.silu_and_mul`, and `fuse_gated_mlps`, which points a model's MLP modules at them
over one merged gate/up projection.

May import `allocator` and `worker.kernels`; never `worker.step` or `worker.engine`.
"""
