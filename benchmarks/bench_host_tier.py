"""The host tier's copies (`TierStore.copy`) next to plain pinned copies of the same bytes, one run.

On CUDA, on the 8B shape (32 layers, 8 KV heads x 128, bf16, 16-token blocks: one block is 2 MiB),
a pool of ``--pool-blocks`` blocks and a tier of ``--tier-slots`` slots, for N of ``--blocks``:
- ``plain``: one pinned cudaMemcpyAsync of N blocks' bytes (a ``copy_(non_blocking=True)``
  between pinned host memory and the device), host to device, device to host, and both at once on
  two streams: what the link gives, the reference of every other figure;
- ``tier``: `TierStore.copy` of N scattered pool blocks to random slots (offload), of N others
  back from random slots (onboard), and both in one call (each direction on a stream of its own);
- ``per_piece``: the same copies made one cudaMemcpyAsync per (block, layer, K/V) piece, the unit
  of the layer-major pool, with no gather: what gathering saves (the host's dispatch of every
  piece included, as a loop over pieces pays it); only up to ``--per-piece-max-blocks`` blocks.
``prefix``: onboarding a ``--prefix-tokens`` prefix (100k tokens: 6250 blocks, ~12.2 GiB) into
scattered pool blocks, from random slots and from consecutive ones, in seconds, next to the plain
copy of its bytes.

Every figure is the median of ``--repeats`` wall times from an idle device to the end of the
copies (synchronised before and after), the variants interleaved repeat by repeat. GB/s is the
bytes carried (each byte once, whichever way) over that time; every variant is also given as a
ratio to the plain copy of the same bytes and directions, and ``overlap`` is (onboard time +
offload time) / time of both at once (2 when the two directions share nothing but the call).

Without CUDA (or with ``--device cpu``): small shapes and ratios only, `TierStore.copy` (index
copies) against `copy_reference` (block by block), so that anyone can try it.

Usage: ``python3 benchmarks/bench_host_tier.py [--quick] [--out results.json]``; prints markdown
tables. ``--quick``: fewer sizes and repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvalloc.allocator.capacity.tier_copies import NO_COPIES, TierCopies
from kvalloc.server.service import tier_store
from kvalloc.server.service.tier_store import TierStore, copy_reference

# The 8B shape on CUDA; a pool and a tier of 16 GiB each at 2 MiB a block.
FULL = {"layers": 32, "kv_heads": 8, "head_dim": 128, "tokens_per_block": 16,
        "pool_blocks": 8192, "tier_slots": 8192, "blocks": [64, 512, 4096],
        "prefix_tokens": 100_000}
# Seconds on a CPU: 16 KiB blocks.
SMALL = {"layers": 2, "kv_heads": 2, "head_dim": 64, "tokens_per_block": 16,
         "pool_blocks": 1024, "tier_slots": 1024, "blocks": [16, 128, 512],
         "prefix_tokens": 8192}
DIRECTIONS = ("onboard", "offload", "both")
GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds from an idle device to the end of everything ``fn`` enqueued."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median_s(variants: dict[str, Callable[[], object]], repeats: int,
             device: torch.device) -> dict[str, float]:
    """Median seconds of each variant, one untimed call each first, then the variants taking
    turns so that drift (clocks, the host's other work) touches all alike."""
    for fn in variants.values():
        wall_s(fn, device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(wall_s(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def scattered(rng: np.random.Generator, store: TierStore, n: int, directions: tuple[str, ...],
              *, consecutive_slots: bool = False) -> tuple[TierCopies, TierCopies]:
    """Onboards and offloads (none when ``directions`` is onboards alone) of ``n`` blocks each:
    distinct pool blocks in random order, distinct slots (random, or each set one run), no block
    or slot shared by the two."""
    sets = 1 if directions == ("onboard",) else 2
    blocks = rng.permutation(store.kv.shape[2])[: sets * n]
    slots = (np.arange(sets * n) if consecutive_slots
             else rng.permutation(store.memory.shape[0])[: sets * n])
    onboards = TierCopies(blocks[:n], slots[:n])
    return onboards, (TierCopies(blocks[n:], slots[n:]) if sets == 2 else NO_COPIES)


def direction_calls(copy: Callable[[TierCopies, TierCopies], object], onboards: TierCopies,
                    offloads: TierCopies) -> dict[str, Callable[[], object]]:
    return {"onboard": lambda: copy(onboards, NO_COPIES),
            "offload": lambda: copy(NO_COPIES, offloads),
            "both": lambda: copy(onboards, offloads)}


class CudaCopies:
    """The references a CUDA run measures `TierStore.copy` against, on the store's own pool and
    memory (no second copy of either): their bytes are taken as flat, contiguous buffers."""

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.pool = store.kv.view(-1).view(torch.uint8)
        self.host = store.memory.view(-1).view(torch.uint8)
        self.streams = {d: torch.cuda.Stream(store.kv.device) for d in ("onboard", "offload")}

    def plain(self, n: int) -> dict[str, Callable[[], object]]:
        """N blocks' bytes in one copy each way; the two ways touch different bytes (the first
        N blocks' worth come in, the next N go out) so both at once is one copy on each stream."""
        size = n * self.store.slot_bytes

        def onboard() -> None:
            with torch.cuda.stream(self.streams["onboard"]):
                self.pool[:size].copy_(self.host[:size], non_blocking=True)

        def offload() -> None:
            with torch.cuda.stream(self.streams["offload"]):
                self.host[size : 2 * size].copy_(self.pool[size : 2 * size], non_blocking=True)

        return {"onboard": onboard, "offload": offload,
                "both": lambda: (onboard(), offload())}

    def per_piece(self, onboards: TierCopies,
                  offloads: TierCopies) -> dict[str, Callable[[], object]]:
        """One copy per (block, layer, K/V) piece: each piece is contiguous on both sides, so
        each is one cudaMemcpyAsync. The views are made before timing: only dispatch counts."""
        kv, memory = self.store.kv, self.store.memory
        layers = kv.shape[0]

        def pieces(copies: TierCopies, inward: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
            pairs = []
            for block, slot in zip(copies.blocks.tolist(), copies.slots.tolist(), strict=True):
                for layer in range(layers):
                    for half in range(2):
                        pool, host = kv[layer, half, block], memory[slot, layer, half]
                        pairs.append((pool, host) if inward else (host, pool))
            return pairs

        def run(pairs: list[tuple[torch.Tensor, torch.Tensor]], direction: str) -> None:
            with torch.cuda.stream(self.streams[direction]):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)

        inward, outward = pieces(onboards, True), pieces(offloads, False)
        return {"onboard": lambda: run(inward, "onboard"),
                "offload": lambda: run(outward, "offload"),
                "both": lambda: (run(inward, "onboard"), run(outward, "offload"))}


def check_landed(store: TierStore, onboards: TierCopies, offloads: TierCopies) -> None:
    """A few pairs of the last copies hold the same bytes on both sides: the figures are of
    copies that happened."""
    sync(store.kv.device)
    for copies in (onboards, offloads):
        for block, slot in list(zip(copies.blocks.tolist(), copies.slots.tolist(),
                                    strict=True))[:: max(1, copies.blocks.size // 3)]:
            if not torch.equal(store.kv[:, :, block].cpu(), store.memory[slot]):
                raise SystemExit(f"bench_host_tier: block {block} and slot {slot} differ")


def cuda_row(name: str, store: TierStore, refs: CudaCopies, rng: np.random.Generator, n: int,
             args: argparse.Namespace, *, consecutive_slots: bool = False,
             directions: tuple[str, ...] = DIRECTIONS) -> dict:
    onboards, offloads = scattered(rng, store, n, directions, consecutive_slots=consecutive_slots)
    tier = direction_calls(store.copy, onboards, offloads)
    store.copy(onboards, offloads)
    check_landed(store, onboards, offloads)
    plain = refs.plain(n)
    variants = {f"plain_{d}": plain[d] for d in directions}
    variants |= {f"tier_{d}": tier[d] for d in directions}
    if n <= args.per_piece_max_blocks:
        pieces = refs.per_piece(onboards, offloads)
        variants |= {f"per_piece_{d}": pieces[d] for d in directions}
    seconds = median_s(variants, args.repeats, store.kv.device)
    row: dict = {"case": name, "blocks": n, "seconds": seconds, "gbps": {}, "vs_plain": {}}
    for key, s in seconds.items():
        direction = key.rsplit("_", 1)[1]
        moved = (2 if direction == "both" else 1) * n * store.slot_bytes
        row["gbps"][key] = moved / s / GB
        row["vs_plain"][key] = seconds[f"plain_{direction}"] / s
    row["bytes_each_way"] = n * store.slot_bytes
    if set(directions) == set(DIRECTIONS):
        row["overlap"] = {how: (seconds[f"{how}_onboard"] + seconds[f"{how}_offload"])
                          / seconds[f"{how}_both"]
                          for how in ("plain", "tier", "per_piece") if f"{how}_both" in seconds}
    return row


def cpu_row(name: str, store: TierStore, rng: np.random.Generator, n: int,
            args: argparse.Namespace, *, consecutive_slots: bool = False,
            directions: tuple[str, ...] = DIRECTIONS) -> dict:
    onboards, offloads = scattered(rng, store, n, directions, consecutive_slots=consecutive_slots)
    tier = direction_calls(store.copy, onboards, offloads)
    reference = direction_calls(lambda on, off: copy_reference(store.kv, store.memory, on, off),
                                onboards, offloads)
    store.copy(onboards, offloads)
    check_landed(store, onboards, offloads)
    variants = {f"{how}_{d}": calls[d] for how, calls in (("reference", reference),
                                                            ("tier", tier))
                for d in directions}
    seconds = median_s(variants, args.repeats, store.kv.device)
    return {"case": name, "blocks": n,
            "tier_vs_reference": {d: seconds[f"reference_{d}"] / seconds[f"tier_{d}"]
                                  for d in directions}}


def markdown_cuda(result: dict) -> str:
    def cell(row: dict, key: str) -> str:
        if key not in row["gbps"]:
            return "- | -"
        return f"{row['gbps'][key]:.1f} | {row['vs_plain'][key]:.2f}"

    lines = ["| case | blocks | direction | plain GB/s | tier GB/s | tier/plain | per-piece GB/s "
             "| per-piece/plain |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["scattered"] + result["prefix"]:
        for d in DIRECTIONS:
            if f"plain_{d}" in row["gbps"]:
                lines.append(f"| {row['case']} | {row['blocks']} | {d} | "
                             f"{row['gbps'][f'plain_{d}']:.1f} | {cell(row, f'tier_{d}')} | "
                             f"{cell(row, f'per_piece_{d}')} |")
    lines += ["", "| case | blocks | overlap plain | overlap tier | overlap per-piece |",
              "|---|---:|---:|---:|---:|"]
    for row in result["scattered"]:
        o = row["overlap"]
        lines.append(f"| {row['case']} | {row['blocks']} | {o['plain']:.2f} | {o['tier']:.2f} | "
                     + (f"{o['per_piece']:.2f} |" if "per_piece" in o else "- |"))
    lines += ["", "| prefix onboard | blocks | GiB | plain s | tier s | tier/plain |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in result["prefix"]:
        s = row["seconds"]
        lines.append(f"| {row['case']} | {row['blocks']} | {row['bytes_each_way'] / 2**30:.2f} | "
                     f"{s['plain_onboard']:.3f} | {s['tier_onboard']:.3f} | "
                     f"{row['vs_plain']['tier_onboard']:.2f} |")
    return "\n".join(lines)


def markdown_cpu(result: dict) -> str:
    lines = ["| case | blocks | " + " | ".join(f"{d}: tier/reference speed" for d in DIRECTIONS)
             + " |", "|---|---:|" + "---:|" * len(DIRECTIONS)]
    for row in result["scattered"] + result["prefix"]:
        ratios = row["tier_vs_reference"]
        lines.append(f"| {row['case']} | {row['blocks']} | "
                     + " | ".join(f"{ratios[d]:.2f}x" if d in ratios else "-"
                                  for d in DIRECTIONS) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "fp8_e4m3"],
                        default="bfloat16", help="the pool's dtype (PoolConfig's names)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--tokens-per-block", type=int)
    parser.add_argument("--pool-blocks", type=int)
    parser.add_argument("--tier-slots", type=int)
    parser.add_argument("--blocks", type=int, nargs="+",
                        help="N, blocks copied each way (the pool and the tier need 2N)")
    parser.add_argument("--prefix-tokens", type=int)
    parser.add_argument("--per-piece-max-blocks", type=int, default=1024,
                        help="the largest N copied piece by piece (its host time grows with N)")
    parser.add_argument("--scratch-mib", type=int,
                        help="the store's scratch per direction (default: the store's own)")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_host_tier: no CUDA device (--device cpu runs the CPU comparison)")
    sizes = FULL if args.device == "cuda" else SMALL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value[:2] if key == "blocks" and args.quick else value)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    return args


def fill_random(target: torch.Tensor, gen: torch.Generator, chunk: int = 256 << 20) -> None:
    """Random bytes, made on the generator's device a chunk at a time (no second copy of a pool
    or a tier of 16 GiB)."""
    flat = target.view(-1).view(torch.uint8)
    for start in range(0, flat.numel(), chunk):
        size = min(chunk, flat.numel() - start)
        flat[start : start + size].copy_(torch.randint(0, 256, (size,), dtype=torch.uint8,
                                                       device=gen.device, generator=gen))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, "float8_e4m3fn" if args.dtype == "fp8_e4m3" else args.dtype)
    prefix_blocks = math.ceil(args.prefix_tokens / args.tokens_per_block)
    room = min(args.pool_blocks, args.tier_slots)
    if 2 * max(args.blocks) > room or prefix_blocks > room:
        sys.exit(f"bench_host_tier: the pool and the tier need {2 * max(args.blocks)} blocks "
                 f"(twice the largest N) and {prefix_blocks} (the prefix); they have {room}")
    if args.scratch_mib is not None:
        tier_store.SCRATCH_BYTES = args.scratch_mib << 20
    kv = torch.empty((args.layers, 2, args.pool_blocks, args.tokens_per_block, args.kv_heads,
                      args.head_dim), dtype=dtype, device=device)
    store = TierStore(kv, args.tier_slots)
    # Fresh memory may read as zeros on both sides, and a copy that never ran would pass the check.
    gen = torch.Generator(device).manual_seed(0)
    for target in (store.kv, store.memory):
        fill_random(target, gen)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "quick": args.quick, "dtype": args.dtype,
        "shape": {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim",
                                                "tokens_per_block")},
        "block_bytes": store.slot_bytes, "pool_blocks": args.pool_blocks,
        "tier_slots": args.tier_slots, "repeats": args.repeats,
        "scratch_slots": max(1, tier_store.SCRATCH_BYTES // store.slot_bytes) if store.cuda
        else None,
        "scattered": [], "prefix": [],
    }
    print(f"pool {kv.nbytes / 2**30:.2f} GiB on {device}, tier {store.memory.nbytes / 2**30:.2f} "
          f"GiB{' pinned' if store.cuda else ''}, {store.slot_bytes / 2**20:.2f} MiB a block",
          flush=True)
    rng = np.random.default_rng(0)
    refs = CudaCopies(store) if store.cuda else None

    def row(name: str, n: int, **kwargs: object) -> dict:
        if refs is not None:
            return cuda_row(name, store, refs, rng, n, args, **kwargs)
        return cpu_row(name, store, rng, n, args, **kwargs)

    for n in args.blocks:
        result["scattered"].append(row("scattered", n))
        write(args.out, result)
    for name, consecutive in (("prefix, random slots", False),
                              ("prefix, consecutive slots", True)):
        result["prefix"].append(row(name, prefix_blocks, consecutive_slots=consecutive,
                                    directions=("onboard",)))
        write(args.out, result)
    print(markdown_cuda(result) if store.cuda else markdown_cpu(result))


def write(out: Path | None, result: dict) -> None:
    """After every row: a run cut short still records what it measured."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
