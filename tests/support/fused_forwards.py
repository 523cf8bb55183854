"""What the fused forwards' tests share: the float dtypes every kernel takes, and the tiny
model shape their modules and models are built at."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
