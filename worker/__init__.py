"""A real inference worker: a `transformers` causal LM decoding speculatively with continuous
batching, its KV in the kvalloc pool and one service call per step (`worker.engine`).

Needs the optional dependencies: ``pip install 'kvalloc[worker]'``.
"""
