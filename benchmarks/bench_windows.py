"""What per-group accounting saves: a long request in a windowed group, and a mixed model's pool.

    python benchmarks/bench_windows.py [--context 32768] [--window 4096] [--json] [--out F]

1. One request decodes (MTP3, lag 2) to ``context`` tokens through a real windowed manager
   (`PoolConfig.window`) and a real full-attention one; reported: the most blocks (and bytes, for
   an 8B-like group: 32 layers x 8 KV heads x 128, bf16, 16-token blocks) it holds while it
   decodes in each, and their ratio.
2. A Gemma-3-like mixed model (48 layers: 40 windowed with W = 1024, 8 full; 8 KV heads x 128,
   bf16, 16-token blocks) at ``context`` tokens, in a pool of ``budget`` GiB: how many such
   requests fit at once

   - *all-full*: every layer accounted as full attention (one table, one pool);
   - *padded*: one page size for every group, the largest group's page (40 layers' block), as a
     single pool of uniform pages lays them out: the 8-layer full group's block is padded to it;
   - *per-group*: kvalloc's groups, each its own pool and block bytes, the budget split between
     them as the requests need.

   Per-request blocks come from real managers (decoded the same way); no GPU is needed.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.allocator import KVCacheManager, PoolConfig, StepPlan

DRAFT = 3
TPB = 16
GIB = 1 << 30


def group(window: int | None, layers: int, context: int) -> PoolConfig:
    rows = -(-(context + 3 * (DRAFT + 1)) // TPB)
    return PoolConfig(num_blocks=rows, tokens_per_block=TPB, num_layers=layers, num_kv_heads=8,
                      head_dim=128, device="cpu", max_batch_size=1,
                      max_seq_len=context + 2 * (DRAFT + 1), max_draft_len=DRAFT,
                      overlap_scheduler=True, window=window)


def held_while_decoding(config: PoolConfig, context: int, steps: int = 64) -> int:
    """The most blocks one request holds over its last ``steps`` decode steps (MTP3, lag 2,
    two drafts accepted a step) up to ``context`` tokens."""
    manager = KVCacheManager(config)
    prompt = context - steps * (DRAFT + 1)
    row = manager.step(StepPlan(prompt_lens=[prompt], lag=2)).admitted_rows
    most = 0
    for k in range(steps):
        results = dict(result_rows=row, num_accepted=[2]) if k >= 2 else {}
        manager.step(StepPlan(grant_rows=row, draft_lens=[DRAFT], lag=2, **results))
        if k >= 2:
            most = max(most, manager.held_blocks)
    manager.check_invariants()
    return most


def long_request(context: int, window: int) -> dict:
    windowed, full = group(window, 32, context), group(None, 32, context)
    held = {"windowed": held_while_decoding(windowed, context),
            "full": held_while_decoding(full, context)}
    return {"context": context, "window": window, "blocks": held,
            "bytes": {k: v * full.bytes_per_block for k, v in held.items()},
            "ratio": round(held["full"] / held["windowed"], 2),
            "bound": windowed.max_live_blocks_per_seq}


def mixed_pool(context: int, budget_gib: float, window: int = 1024) -> dict:
    full_cfg, win_cfg = group(None, 8, context), group(window, 40, context)
    all_cfg = group(None, 48, context)
    full_blocks = held_while_decoding(full_cfg, context)
    win_blocks = held_while_decoding(win_cfg, context)
    budget = int(budget_gib * GIB)
    per_request = {
        "all_full": full_blocks * all_cfg.bytes_per_block,
        "padded": (full_blocks + win_blocks) * max(full_cfg.bytes_per_block,
                                                   win_cfg.bytes_per_block),
        "per_group": full_blocks * full_cfg.bytes_per_block
                     + win_blocks * win_cfg.bytes_per_block,
    }
    fits = {k: budget // v for k, v in per_request.items()}
    return {"context": context, "window": window, "budget_gib": budget_gib,
            "layers": {"full": 8, "windowed": 40},
            "blocks_per_request": {"full": full_blocks, "windowed": win_blocks},
            "bytes_per_request": per_request, "concurrent_requests": fits,
            "gain_over_all_full": round(fits["per_group"] / max(1, fits["all_full"]), 2),
            "gain_over_padded": round(fits["per_group"] / max(1, fits["padded"]), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768, help="tokens per request")
    p.add_argument("--window", type=int, default=4096, help="the long request's window")
    p.add_argument("--budget", type=float, default=40.0, help="the mixed pool's GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args()
    long = long_request(args.context, args.window)
    mixed = mixed_pool(args.context, args.budget)
    if long["ratio"] < 6:
        raise SystemExit(f"bench_windows: a windowed group saves only {long['ratio']}x")
    result = {"benchmark": "bench_windows", "date": date.today().isoformat(),
              "long_request": long, "mixed_pool": mixed}
    fits = mixed["concurrent_requests"]
    rows = {
        f"{args.context} tokens, W={args.window}": (
            f"windowed {long['blocks']['windowed']} blocks "
            f"({long['bytes']['windowed'] / 2**20:.0f} MiB), full {long['blocks']['full']} "
            f"({long['bytes']['full'] / 2**20:.0f} MiB): {long['ratio']}x less"),
        f"mixed 40W:8F, {args.budget:g} GiB": (
            f"all-full {fits['all_full']}, padded {fits['padded']}, "
            f"per-group {fits['per_group']} requests"),
    }
    bench_step.emit(result, rows, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
