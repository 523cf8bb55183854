"""The model's RMSNorms in one launch each: `rms_norm` (transformers' RMSNorm arithmetic in
plain torch, the reference; its Triton launch, `rms_norm_triton`, with the kernel in
`worker.kernels.rms_norm`; and `fuse_rms_norms`, which points a model's RMSNorm modules at
them).

May import `allocator` and `worker.kernels`; never `worker.step` or `worker.engine`.
"""
