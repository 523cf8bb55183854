"""NWOR commit and SCV acceptance on the GPU, side by side in one run.

1. Commit bandwidth, 1k..64k tokens x 8 KV heads x 128 dims x bf16 x 4 layers (K and V): the fused
   Triton commit vs ``torch.index_copy_`` per layer and K/V vs a contiguous device copy of the same
   bytes (the ceiling), and the fused commit fenced by an open writer's word (what every product
   commit carries). GB/s counts bytes read + written. Target: at >= 16k tokens the fused
   commit reaches >= 70% of the ceiling and >= 2x index_copy_.
2. A decode step: batch 64, MTP3 (4 tokens each), 32 layers, random acceptance. Acceptance mask +
   commit eagerly vs one CUDA-graph replay, and the byte floor (bytes the commit must move at the
   measured copy bandwidth). Target: replay within 2x the byte floor + 15 us.
3. The acceptance mask for batch 256 (3 drafts each): eager vs SCV graph replay.

Usage: ``python3 benchmarks/bench_commit.py --out results.json [--quick]``; prints markdown tables.
Needs CUDA and Triton. ``--quick`` is a seconds-long smoke run with fewer sizes and repeats.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.nwor.acceptance import ScvAcceptor, ScvMode, time_cuda_ms
from kvalloc.allocator.nwor.commit_kernel import write_staged
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.fence import WriterFence
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import WindowLayout

HEADS, DIM, TPB = 8, 128, 16
ROW = HEADS * DIM
BF16 = torch.bfloat16


def loop_us(fn: Callable[[], object], *, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean device time of ``iters`` back-to-back calls, in us."""
    return statistics.median(time_cuda_ms(fn, iters) * 1e3 for _ in range(repeats))


def call_us(fn: Callable[[], object], prepare: Callable[[], object], *, repeats: int) -> float:
    """Median time of one call from an idle device: launch latency and host overhead included."""
    times = []
    for _ in range(repeats + 2):
        prepare()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def copy_ceiling_gbps(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 2, dtype=BF16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = loop_us(lambda: dst.copy_(src), iters=10, repeats=repeats)
    return 2 * nbytes / us / 1e3


def paged_slots(num_tokens: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A realistic slot mapping: whole blocks of consecutive slots, blocks in random order."""
    blocks = torch.randperm(num_blocks, device="cuda", generator=gen)[: math.ceil(num_tokens / TPB)]
    return (blocks[:, None] * TPB + torch.arange(TPB, device="cuda")).flatten()[:num_tokens]


def bench_bandwidth(sizes: list[int], repeats: int, layers: int = 4) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in sizes:
        rows.append(_bandwidth_row(n, layers, repeats, gen))
        torch.cuda.empty_cache()
    return rows


def _bandwidth_row(n: int, layers: int, repeats: int, gen: torch.Generator) -> dict:
    staged = torch.randn(layers, 2, n, ROW, dtype=BF16, device="cuda", generator=gen)
    num_blocks = 2 * math.ceil(n / TPB)
    pool = torch.zeros(layers, 2, num_blocks * TPB, ROW, dtype=BF16, device="cuda")
    slots = paged_slots(n, num_blocks, gen)
    slots_2d = slots.expand(layers, n).contiguous()
    layer_rows = torch.full((layers,), n, dtype=torch.int64, device="cuda")
    flat_src = staged.view(-1)
    flat_dst = torch.empty_like(flat_src)

    def index_copy() -> None:
        for layer in range(layers):
            for kv in range(2):
                pool[layer, kv].index_copy_(0, slots, staged[layer, kv])

    # A writer's fence (its session's word, open): what every product commit carries.
    fence = WriterFence.of(torch.full((1,), 7, dtype=torch.int64, device="cuda"), 7)
    nbytes = 2 * staged.numel() * staged.element_size()  # read + write
    iters = max(5, min(200, int(4e9 // nbytes)))
    us = {
        "fused": loop_us(lambda: write_staged(pool, staged, slots_2d, layer_rows, n,
                                              backend="triton"), iters=iters, repeats=repeats),
        "fused_fenced": loop_us(lambda: write_staged(pool, staged, slots_2d, layer_rows, n,
                                                     backend="triton", fence=fence),
                                iters=iters, repeats=repeats),
        "index_copy": loop_us(index_copy, iters=iters, repeats=repeats),
        "copy_ceiling": loop_us(lambda: flat_dst.copy_(flat_src), iters=iters, repeats=repeats),
    }
    gbps = {k: nbytes / v / 1e3 for k, v in us.items()}
    return {
        "tokens": n, "layers": layers, "bytes": nbytes, "us": us, "gbps": gbps,
        "fused_vs_ceiling": gbps["fused"] / gbps["copy_ceiling"],
        "fused_vs_index_copy": gbps["fused"] / gbps["index_copy"],
        "fenced_vs_fused": gbps["fused_fenced"] / gbps["fused"],
    }


def accepting_inputs(accepted: torch.Tensor, drafts: int, gen: torch.Generator):
    """Drafts and a rejection sampler's [batch, drafts + 1] output accepting ``accepted``."""
    batch = accepted.shape[0]
    draft_ids = torch.randint(0, 32000, (batch, drafts), device="cuda", generator=gen)
    pos = torch.arange(drafts + 1, device="cuda")
    sampled = torch.full((batch, drafts + 1), -1, dtype=torch.int64, device="cuda")
    agree = pos[None, :drafts] < accepted[:, None]
    sampled[:, :drafts] = torch.where(agree, draft_ids, draft_ids + 1)
    sampled[pos[None, :] > accepted[:, None]] = -1
    return draft_ids, sampled


def bench_decode_step(repeats: int, ceiling_gbps: float, batch: int = 64, drafts: int = 3,
                      layers: int = 32) -> dict:
    cfg = PoolConfig(num_blocks=2048, tokens_per_block=TPB, num_layers=layers,
                     num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16", device="cuda",
                     max_batch_size=batch, max_seq_len=4096, max_draft_len=drafts)
    storage = KVStorage(cfg)
    gen = torch.Generator(device="cuda").manual_seed(1)
    layout = WindowLayout.decode([drafts] * batch)
    n = layout.total_tokens
    # Each request's 1 + D tokens are consecutive slots inside one of its blocks.
    blocks = torch.randperm(cfg.total_blocks, device="cuda", generator=gen)[:batch]
    offsets = torch.randint(0, TPB - drafts, (batch,), device="cuda", generator=gen)
    slots = ((blocks * TPB + offsets)[:, None] + torch.arange(1 + drafts, device="cuda")).flatten()
    keys = torch.randn(layers, n, HEADS, DIM, dtype=BF16, device="cuda", generator=gen)
    values = torch.randn(layers, n, HEADS, DIM, dtype=BF16, device="cuda", generator=gen)
    accepted = torch.randint(0, drafts + 1, (batch,), device="cuda", generator=gen)
    draft_ids, sampled = accepting_inputs(accepted, drafts, gen)

    eager = DeferredWriteManager(storage, max_tokens=n)
    graphed = DeferredWriteManager(storage, max_tokens=n)
    graphed.graphs.capture_verify(n, max_requests=batch, width=drafts + 1)
    commit_graphed = DeferredWriteManager(storage, max_tokens=n)
    commit_graphed.graphs.capture_commit(n)

    def stage(mgr: DeferredWriteManager) -> Callable[[], None]:
        def prepare() -> None:
            mgr.begin_window(layout)
            for layer in range(layers):
                mgr.stage_layer(layer, keys[layer], values[layer], slots)
        return prepare

    # "call": one public call from an idle device, host overhead included. "replay": the captured
    # graph alone, back to back (re-committing the last window rewrites the same rows).
    result = {
        "batch": batch, "drafts": drafts, "layers": layers, "tokens": n,
        "mask_commit_eager_call_us": call_us(lambda: eager.verify_and_commit(draft_ids, sampled),
                                             stage(eager), repeats=repeats),
        "mask_commit_graph_call_us": call_us(
            lambda: graphed.verify_and_commit(draft_ids, sampled), stage(graphed),
            repeats=repeats),
        "mask_commit_graph_replay_us": loop_us(graphed.graphs.captured.verify[0].graph.replay,
                                               iters=50, repeats=repeats),
        "commit_eager_call_us": call_us(lambda: eager.commit(accepted), stage(eager),
                                        repeats=repeats),
        "commit_graph_call_us": call_us(lambda: commit_graphed.commit(accepted),
                                        stage(commit_graphed), repeats=repeats),
        "commit_graph_replay_us": loop_us(commit_graphed.graphs.captured.commit[0].graph.replay,
                                          iters=50, repeats=repeats),
    }
    assert graphed.last_window is not None and graphed.last_window.path == "graph"
    assert graphed.metrics().fallbacks == {} and eager.metrics().fallbacks == {}
    kept = n - int((drafts - accepted).sum())
    floor_bytes = 2 * kept * layers * 2 * ROW * 2  # K and V rows, read from staging + written
    floor_us = floor_bytes / ceiling_gbps / 1e3
    result.update({
        "kept_tokens": kept, "floor_bytes": floor_bytes, "copy_gbps": ceiling_gbps,
        "byte_floor_us": floor_us, "target_us": 2 * floor_us + 15,
    })
    del storage
    torch.cuda.empty_cache()
    return result


def bench_acceptance(repeats: int, batch: int = 256, drafts: int = 3) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(2)
    accepted = torch.randint(0, drafts + 1, (batch,), device="cuda", generator=gen)
    draft_ids, sampled = accepting_inputs(accepted, drafts, gen)
    num_draft = torch.full((batch,), drafts, device="cuda")
    flat = draft_ids.flatten()
    out = {"batch": batch, "drafts": drafts}
    for layout, ids in (("padded", draft_ids), ("flat", flat)):
        for mode in (ScvMode.OFF, ScvMode.GRAPH):
            acceptor = ScvAcceptor(mode)
            counts = acceptor(ids, sampled, num_draft)[1]
            assert torch.equal(counts, accepted)
            call = functools.partial(acceptor, ids, sampled, num_draft)
            out[f"{layout}_{mode.value}_call_us"] = call_us(call, lambda: None, repeats=repeats)
            out[f"{layout}_{mode.value}_back_to_back_us"] = loop_us(call, iters=50,
                                                                     repeats=repeats)
    return out


def markdown(results: dict) -> str:
    lines = ["| tokens | fused GB/s | fused, fenced GB/s | index_copy_ GB/s | copy ceiling GB/s "
             "| fused/ceiling | fused/index_copy_ | fenced/fused |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["bandwidth"]:
        g = r["gbps"]
        lines.append(f"| {r['tokens']} | {g['fused']:.0f} | {g['fused_fenced']:.0f} | "
                     f"{g['index_copy']:.0f} | {g['copy_ceiling']:.0f} | "
                     f"{r['fused_vs_ceiling']:.0%} | {r['fused_vs_index_copy']:.2f}x | "
                     f"{r['fenced_vs_fused']:.2f} |")
    d = results["decode_step"]
    lines += ["", "| decode step (64 x MTP3, 32 layers) | us |", "|---|---:|"]
    for key in ("mask_commit_eager_call_us", "mask_commit_graph_call_us",
                "mask_commit_graph_replay_us", "commit_eager_call_us", "commit_graph_call_us",
                "commit_graph_replay_us", "byte_floor_us", "target_us"):
        lines.append(f"| {key.removesuffix('_us')} | {d[key]:.1f} |")
    a = results["acceptance"]
    lines += ["", f"| acceptance mask, batch {a['batch']} | eager us | graph us |",
              "|---|---:|---:|"]
    for layout in ("padded", "flat"):
        for how in ("call", "back_to_back"):
            lines.append(f"| {layout}, {how.replace('_', ' ')} | "
                         f"{a[f'{layout}_off_{how}_us']:.1f} | "
                         f"{a[f'{layout}_graph_{how}_us']:.1f} |")
    lines += ["", "| target | met |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in results["targets"].items()]
    return "\n".join(lines)


def targets(results: dict) -> dict:
    big = [r for r in results["bandwidth"] if r["tokens"] >= 16384]
    d = results["decode_step"]
    return {
        "fused >= 70% of copy ceiling at >= 16k tokens":
            bool(big) and all(r["fused_vs_ceiling"] >= 0.7 for r in big),
        "fused >= 2x index_copy_ at >= 16k tokens":
            bool(big) and all(r["fused_vs_index_copy"] >= 2.0 for r in big),
        "decode mask + commit replay <= 2x byte floor + 15 us":
            d["mask_commit_graph_replay_us"] <= d["target_us"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="smoke run: few sizes and repeats")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_commit.py needs CUDA")
    import triton

    repeats = 3 if args.quick else 7
    sizes = [1024, 16384] if args.quick else [1024 << i for i in range(7)]
    ceiling = copy_ceiling_gbps(256 << 20, repeats)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "quick": args.quick,
        "bandwidth": bench_bandwidth(sizes, repeats),
        "decode_step": bench_decode_step(repeats * 5, ceiling),
        "acceptance": bench_acceptance(repeats * 5),
    }
    results["targets"] = targets(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
