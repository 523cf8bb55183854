"""The worker's Triton kernels, one module each, and what their launches share.

Each kernel module holds plain Python functions and their ``triton.jit`` wrappers, and imports
Triton: only a launch imports it, after its dispatch rule found Triton installed. Each kernel's
plain torch twin, the reference it is tested against, lives with its launch in its room:

- `rms_norm`: transformers' RMSNorm in one pass (reference: `worker.norm.rms_norm.rms_norm`);
- `silu_and_mul`: SiLU and the product of a merged gate/up projection (reference:
  `worker.mlp.gated_mlp.silu_and_mul`);
- `rotate_and_stage`: the rotary embedding of Q and K and the staging of K and V (reference:
  `worker.attention.rotary.rotate_and_stage_reference`);
- `pool_attention`: the paged two-source attention (reference:
  `worker.attention.pool_attention.pool_attention`, launched by
  `worker.attention.pool_attention_triton`);
- `latent_attention`: MLA over a latent pool (reference:
  `worker.attention.latent_attention.latent_attention`, launched by
  `worker.attention.latent_attention_triton`);
- `online_softmax`: the online-softmax update both attention kernels run on their scores;
- `step_metadata`: a step's per-token ids, positions and slots (reference:
  `worker.step.step_metadata.metadata_reference`);
- `helpers`: what the launches and dispatch rules share (the interpreter for CPU tensors, the
  dtypes the kernels take, powers of two); it never imports Triton at import time.

May import `allocator`; nothing else of the worker: the rooms launch their kernels, never the
other way round.
"""
