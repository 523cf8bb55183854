"""A real inference worker: a `transformers` causal LM decoding speculatively with continuous
batching, its KV in the kvalloc pool and one service call per step (`worker.engine`), either
synchronously or one step ahead of the host (an overlap worker).

- the loop: `engine` (planning, the calls, reading each step's outcome), `device_step` (a step's
  forward, verification and an overlap worker's commit, launched without reading back), `rows`
  (each block-table row's state on the device), `step_metadata` (+ its Triton kernel), `commit`;
- the model: `model` (loading), `attention` (transformers' hook), `pool_attention` (the
  two-source attention reference) and its Triton kernel (`pool_attention_kernel`, dispatched by
  `pool_attention_triton`), `drafters`;
- `cli`: ``kvalloc worker``.

May import `allocator` and `server` (it is the client's user); nothing imports it.
Needs the optional dependencies: ``pip install 'kvalloc[worker]'``.
"""
