"""`mask_rejected`: the first half of NWOR's device commit. Accepted counts -> per-token keep mask
-> every rejected token's slot set to -1 in every layer, plus the window's counters. The second
half, `commit_kernel.write_staged`, then writes the surviving rows.

Per-window buffers (the manager's, filled when the window opens):
- ``tokens``: int64 ``[>= num_rows, 3]``, per token its request, its draft index (< 0 for a
  non-draft token, ``NEVER`` for a row past the window) and its histogram bucket;
- ``accepted``: int64 ``[R]``, accepted drafts per request;
- ``limits``: int64 ``[R + 1]``, per request the most it may accept (its draft count, ``NEVER``
  for a padded request), then the window's token count.

A token is kept iff its draft index < its request's accepted count (`window_maths.keep_rule`,
which the Triton kernel states inline). If any count lies outside
``[0, limit]`` every token of the window is kept instead: the fallback writes everything, never a
clamped guess. ``counters = (window[3], total[3], per_position[P + 1])``, when given, receive
(committed tokens or 0 when the counts were invalid, 1 if they were, the window's tokens if they
were): ``window`` is overwritten, ``total`` accumulates, ``per_position`` counts committed tokens
by bucket (the last bucket collects non-draft tokens).

Both backends give identical results; the Triton one is a single launch (plus zeroing ``window``)
with no host synchronisation, so it is captured in the commit's CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator.nwor.commit_kernel import Backend, resolve_backend
from kvalloc.allocator.nwor.window_maths import keep_rule

NEVER = 1 << 62  # a draft index no count reaches, and a limit no count exceeds
_BLOCK_T = 256  # tokens per program


def mask_rejected(tokens: torch.Tensor, accepted: torch.Tensor, limits: torch.Tensor,
                  slots: torch.Tensor, num_rows: int, out: torch.Tensor,
                  counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                  backend: Backend = "auto") -> None:
    """``out[:, :num_rows] = slots[:, :num_rows]`` with rejected tokens' slots set to -1."""
    if num_rows == 0:
        if counters is not None:
            counters[0].zero_()
        return
    if resolve_backend(backend, slots.device) == "torch":
        _mask_rejected_torch(tokens, accepted, limits, slots, num_rows, out, counters)
        return
    from kvalloc.allocator.nwor import commit_triton as ct

    kernel = ct.mask_rejected_jit if slots.is_cuda else ct.interpreted("mask_rejected")
    window, total, hist = counters if counters is not None else (accepted,) * 3
    if counters is not None:
        window.zero_()
    num_requests = accepted.shape[0]
    kernel[(ct.cdiv(num_rows, _BLOCK_T), slots.shape[0])](
        tokens, accepted, limits, slots, out, window, total, hist,
        num_rows, num_requests, slots.stride(0), out.stride(0),
        NEVER=NEVER, BLOCK_T=_BLOCK_T, BLOCK_R=1 << max(0, num_requests - 1).bit_length(),
        RECORD=counters is not None,
    )


def _mask_rejected_torch(tokens: torch.Tensor, accepted: torch.Tensor, limits: torch.Tensor,
                         slots: torch.Tensor, num_rows: int, out: torch.Tensor,
                         counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    if counters is None and not slots.is_cuda:
        _mask_rejected_numpy(tokens, accepted, limits, slots, num_rows, out)
        return
    request, draft_index, bucket = tokens[:num_rows].unbind(1)
    invalid = ((accepted < 0) | (accepted > limits[:-1])).any()
    keep = keep_rule(draft_index, request, torch.where(invalid, NEVER, accepted))
    out[:, :num_rows] = torch.where(keep, slots[:, :num_rows], -1)
    if counters is None:
        return
    window, total, hist = counters
    committed = (keep & ~invalid).to(torch.int64)
    flag = invalid.to(torch.int64)
    delta = torch.stack([committed.sum(), flag, flag * limits[-1]])
    window.copy_(delta)
    total.add_(delta)
    hist.scatter_add_(0, bucket, committed)


def _mask_rejected_numpy(tokens: torch.Tensor, accepted: torch.Tensor, limits: torch.Tensor,
                         slots: torch.Tensor, num_rows: int, out: torch.Tensor) -> None:
    """The same rule through numpy views of the same CPU buffers: on a CPU pool the commit is on
    the service's per-step path, and torch's per-op dispatch costs more than the work."""
    t, acc = tokens[:num_rows].numpy(), accepted.numpy()
    invalid = ((acc < 0) | (acc > limits[:-1].numpy())).any()
    keep = keep_rule(t[:, 1], t[:, 0], np.full_like(acc, NEVER) if invalid else acc)
    out[:, :num_rows].numpy()[:] = np.where(keep, slots[:, :num_rows].numpy(), -1)
