"""What a step call's messages cost to encode and decode on both sides of the stream socket.

    python benchmarks/bench_codec.py [--batches 64 256] [--repeat N] [--json] [--out results.json]

`bench_step`'s decode workload (MTP3, an attached worker) runs through a `ServiceCore` in this
process until its batch is full; one more step's `StepCall` and `StepResult` are then taken
through what the stream socket (and ZeroMQ, the same frames) does to them besides moving bytes:

- ``caller_encode``: `StepCall.to_wire`, msgpack, the frames packed into one message;
- ``service_decode``: the frames unpacked, the request decoded and `StepCall.from_wire` (every
  column checked);
- ``service_encode``: `StepResult.to_wire`, msgpack, the reply's frames packed;
- ``caller_decode``: the reply's frames unpacked, decoded and `StepResult.from_wire`;

and ``total``, their sum. Each is the best of ``--repeat`` timings of 200 calls (a few
milliseconds each), in microseconds: what a call costs on a quiet core, which other load on the
machine moves little (unlike a round trip's wake-ups).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import timeit
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall, StepResult
from kvalloc.server.contract.operations import OK, OPERATIONS
from kvalloc.server.transport import stream

STEP = OPERATIONS["step"]
SEQ = (1).to_bytes(8, "big")


def best_us(work: Callable[[], object], repeat: int, number: int = 200) -> float:
    work()
    return round(min(timeit.repeat(work, number=number, repeat=repeat)) / number * 1e6, 2)


def stages(call: StepCall, result: StepResult) -> dict[str, Callable[[], object]]:
    request = stream.pack([SEQ, b"", b"step", wire.encode_msgpack(call.to_wire(binary=True))])
    reply = stream.pack([SEQ, OK, wire.encode_msgpack(result.to_wire(binary=True))])

    def caller_encode() -> bytes:
        return stream.pack([SEQ, b"", b"step",
                            wire.encode_msgpack(STEP.encode_call(call, binary=True))])

    def service_decode() -> StepCall:
        payload = stream.unpack(memoryview(request)[stream.LENGTH.size:])[3]
        return STEP.to_core(wire.decode(payload, STEP.request_struct(binary=True)))

    def service_encode() -> bytes:
        return stream.pack([SEQ, OK, wire.encode_msgpack(STEP.from_core(result, binary=True))])

    def caller_decode() -> StepResult:
        payload = stream.unpack(memoryview(reply)[stream.LENGTH.size:])[2]
        return STEP.decode_reply(wire.decode(payload, STEP.reply_struct(binary=True)))

    assert service_decode() == call and caller_decode() == result
    return {"caller_encode": caller_encode, "service_decode": service_decode,
            "service_encode": service_encode, "caller_decode": caller_decode}


def measure(batch: int, repeat: int) -> dict[str, float]:
    step = bench_step.InProcessService(bench_step.Setup(batch, 0, "cpu", steps=4))
    try:
        while not step.workload.full:
            step.observe(step.run(step.prepare()))
        call = step.prepare()
        result = step.run(call)
        out = {name: best_us(work, repeat) for name, work in stages(call, result).items()}
    finally:
        step.close()
    return {**out, "total": round(sum(out.values()), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256],
                   help="requests per step (default: 64 256)")
    p.add_argument("--repeat", type=int, default=50, help="timings per stage (default 50)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON results here")
    args = p.parse_args()
    batches = {str(b): measure(b, args.repeat) for b in args.batches}
    result: dict[str, Any] = {
        "benchmark": "bench_codec", "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "repeat": args.repeat, "batches": batches}
    rows = {f"batch {b} {name}": value for b, r in batches.items() for name, value in r.items()}
    bench_step.emit(result, rows, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
