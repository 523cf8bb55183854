"""A real inference worker: a `transformers` causal LM decoding speculatively with continuous
batching, its KV in the kvalloc pool and one service call per step (`worker.engine`), either
synchronously or one step ahead of the host (an overlap worker).

- `engine`: the loop (the calls, admission, launching each step and reading its outcome), with
  `step_plans` (each call's plan), `launch_plans` (each reply checked into the device step's
  plan), `requests` (a request's progress) and `run_stats` (a run's figures and device time);
  `step/`: one step on the device (its metadata, forward, verification and an overlap worker's
  commit); `errors`: the worker's one error tree;
- `model` (loading), `attention/` (attention straight from the pool: transformers' hook, the
  reference and its Triton launches, the attention module's forward with rotary and staging in
  one launch, MLA over a latent pool), `norm/` (the model's RMSNorms in one launch each, the
  reference beside the launch), `mlp/` (gated MLPs in two GEMMs and one launch), `kernels/` (the
  Triton kernels of all of them and of the step's metadata, and what their launches share),
  `module_forwards` (how those kernels take over transformers' modules, per instance, and
  projections merge into one GEMM), `fusion` (the one switch to all of them), `drafters`;
- `cli`: ``kvalloc worker``, its flags in `arguments` (which imports nothing heavy, for
  ``--help``).

May import `allocator` and `server`'s client and contract (it is the client's user; its
``--in-process`` service comes from `server.client.in_process_client`), and
`server.serve_arguments` to spell the ``kvalloc serve`` flags a refusal proposes; never
`server.service`; nothing imports it.
Needs the optional dependencies: ``pip install 'kvalloc[worker]'``.
"""
