"""Attention straight from the kvalloc pool: `hook` (transformers' ``AttentionInterface``
function the model calls in every layer, and the step it reads), `pool_attention` (the step's
layout on the device and the two-source attention in plain torch: the reference), its Triton
launches and dispatch rule (`pool_attention_triton`), and `rotary` (the attention module's
forward with the rotary embedding and the staging in one launch; transformers' own forward is
its reference); and MLA over a latent pool: `mla` (DeepSeek-V3's attention module's forward),
`latent_attention` (the absorbed-weight reference) and `latent_attention_triton` (its launch and
dispatch rule). The kernels themselves live in `worker.kernels`.

May import `allocator` and `worker.kernels`; never `worker.step` or `worker.engine` (the loop
uses attention, not the other way round).
"""
