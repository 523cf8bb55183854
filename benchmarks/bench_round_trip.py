"""The floor of a local round trip, with no service behind it: ZeroMQ, as the IPC transport uses
it (DEALER to ROUTER over ``ipc://``), against a plain Unix stream socket.

    python benchmarks/bench_round_trip.py [--calls N] [--json] [--out results.json]

A peer process answers every request (8 KB, a batch-256 step call) with 12 KB (its reply) after
``service_us`` of busy work, the share of the service's own step; the caller waits ``gap_us``
between calls, as a worker runs its forward between two steps. The figure is the round trip
minus ``service_us``: what the transport adds. ZeroMQ moves each message through a background
I/O thread on both sides, so a round trip wakes four threads besides the two that send and
receive; a stream socket wakes only the receiver. Where waking an idle thread is slow (some
virtual machines), that difference grows with the time the threads sleep, that is with
``service_us`` and ``gap_us``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import zmq

REQUEST, REPLY = 8000, 12000
CASES = [(0, 0), (1000, 0), (1000, 2000)]  # (service_us, gap_us)
_LENGTH = struct.Struct("<I")


def _busy(us: int) -> None:
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


def _zmq_peer(address: str, ready: Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    reply = b"r" * REPLY
    while True:
        peer, payload = sock.recv_multipart()
        if payload == b"stop":
            sock.send_multipart([peer, b"stop"])
            break
        _busy(int(payload[:8]))
        sock.send_multipart([peer, reply])
    sock.close()
    ctx.term()


def _read(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _unix_peer(path: str, ready: Event) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    ready.set()
    conn, _ = server.accept()
    reply = _LENGTH.pack(REPLY) + b"r" * REPLY
    while True:
        payload = _read(conn, _LENGTH.unpack(_read(conn, _LENGTH.size))[0])
        if payload == b"stop":
            break
        _busy(int(payload[:8]))
        conn.sendall(reply)
    conn.close()
    server.close()


def _measure(call: Callable[[bytes], None], service_us: int, gap_us: int, calls: int) -> float:
    request = b"%08d" % service_us + b"q" * (REQUEST - 8)
    taken = []
    for _ in range(calls):
        if gap_us:
            time.sleep(gap_us / 1e6)
        t0 = time.perf_counter_ns()
        call(request)
        taken.append((time.perf_counter_ns() - t0) / 1e3 - service_us)
    return round(statistics.median(taken[calls // 5:]), 1)


def zmq_round_trips(workdir: Path, calls: int) -> dict[str, float]:
    address = f"ipc://{workdir / 'zmq.ipc'}"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    peer = ctx.Process(target=_zmq_peer, args=(address, ready))
    peer.start()
    ready.wait(30)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.connect(address)

    def call(request: bytes) -> None:
        sock.send(request)
        sock.recv()

    out = {f"{s}_{g}": _measure(call, s, g, calls) for s, g in CASES}
    sock.send(b"stop")
    sock.recv()
    peer.join()
    sock.close()
    zctx.term()
    return out


def unix_round_trips(workdir: Path, calls: int) -> dict[str, float]:
    path = str(workdir / "stream.sock")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    peer = ctx.Process(target=_unix_peer, args=(path, ready))
    peer.start()
    ready.wait(30)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)

    def call(request: bytes) -> None:
        conn.sendall(_LENGTH.pack(len(request)) + request)
        _read(conn, _LENGTH.unpack(_read(conn, _LENGTH.size))[0])

    out = {f"{s}_{g}": _measure(call, s, g, calls) for s, g in CASES}
    conn.sendall(_LENGTH.pack(4) + b"stop")
    peer.join()
    conn.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="round trips per case (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON results here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvrt-") as tmp:
        results = {"zeromq": zmq_round_trips(Path(tmp), args.calls),
                   "unix_stream": unix_round_trips(Path(tmp), args.calls)}
    report = {"benchmark": "bench_round_trip",
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         f"{platform.python_version()}",
              "request_bytes": REQUEST, "reply_bytes": REPLY, "calls": args.calls,
              "added_us": results,
              "cases": "service_us_gap_us: the transport's added median microseconds"}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        json.dump(report, sys.stdout)
        print()
        return
    print("| transport | " + " | ".join(f"service {s} us, gap {g} us" for s, g in CASES) + " |")
    print("|---|" + "---:|" * len(CASES))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[f'{s}_{g}']:.0f}" for s, g in CASES) + " |")


if __name__ == "__main__":
    main()
