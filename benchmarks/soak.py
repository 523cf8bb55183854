"""Soak: a real `kvalloc serve` under several `kvalloc loadgen` workers for minutes, with
register/deregister churn beside them; reports steps, errors, leaked blocks, and the service's
RSS and open descriptors at the start and the end.

    python benchmarks/soak.py                       # 10 minutes, 6 workers (on demand)
    python benchmarks/soak.py --duration 5 --workers 2 --json
    python benchmarks/soak.py --no-prefix-caching   # the plain pool: no cache, no events
    python benchmarks/soak.py --overlap-workers 2    # and 2 more workers one step ahead (lag 2)

Workers alternate between IPC and REST over TCP. ``--overlap-workers`` adds loadgens that run
one step ahead (``kvalloc loadgen --overlap``: registered as overlap workers, results two calls
late) beside the synchronous ones. By default the service caches prompt prefixes
and publishes KV events, and every worker sends its prompts' token ids (a system prompt of
``SHARED_PREFIX`` tokens, then its own): the cache's refcounts, parking and eviction, and the
event publisher's thread and buffer, are what a soak must watch too. A subscriber running as the
service's user reads the events for the whole run (`server.devtools.event_subscriber`), replaying
any gap, and catches up at the end.

A healthy run ends with no errors, no request left and no block leaked (every block still off
the free stack is a parked cache block), invariants holding (``GET /v1/pool?verify=true``), the
subscriber's cached blocks equal to the service's ``kvalloc_prefix_cached_blocks``, no event
batch lost and no anomaly in the events, the same descriptor count as at the start, and RSS flat
after warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvalloc.server.client import Client
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.contract.wire import PoolState
from kvalloc.server.devtools.event_subscriber import EventCounts, KVEventSubscriber
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from prometheus_client.parser import text_string_to_metric_families

POOL = ("--device", "cpu", "--num-blocks", "4096", "--tokens-per-block", "16",
        "--max-batch-size", "256", "--max-seq-len", "4096", "--max-step-tokens", "4096",
        "--max-workers", "16", "--lease-ttl-s", "10")
SHARED_PREFIX = 128  # tokens of each worker's system prompt: 8 blocks shared by its requests
CHURN_ID = "soak-churn"
CHURN_PROMPT = list(range(16))  # one block, freed before it is ever written (so never cached)
# A scrape serves the copy of the state the service took at a change, at most every
# `allocator.metrics.AllocatorMetrics.min_interval_s` (0.25 s); after that long without a
# change, the next change is copied.
METRICS_INTERVAL_S = 0.25
HANDSHAKE_S = 30.0  # a CURVE handshake on loopback takes about a millisecond


def process_usage(pid: int) -> dict[str, int]:
    """The process's resident memory (KiB) and open descriptors now."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Churn(threading.Thread):
    """Registers and deregisters a short-lived worker over and over until stopped."""

    def __init__(self, address: str, token: str) -> None:
        super().__init__(name=CHURN_ID, daemon=True)
        self.address, self.token = address, token
        self.cycles = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with Client(self.address, worker_id=CHURN_ID, token=self.token) as client:
            while not self.stop.wait(0.05):
                try:
                    client.register(attach=False)
                    client.step(new=(["c"], [len(CHURN_PROMPT)]), prompt_token_ids=CHURN_PROMPT)
                    client.deregister()
                    self.cycles += 1
                except Exception as exc:  # counted, never fatal: the soak reports it
                    self.errors.append(f"{type(exc).__name__}: {exc}")


class EventWatch(threading.Thread):
    """Reads the service's KV events until stopped, then catches up with the last batches. The
    subscriber lives on this thread alone (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str, replay_endpoint: str, worker_ids: list[str]) -> None:
        super().__init__(name="soak-events", daemon=True)
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        # One stream for the service: its hashes cover each block's namespace, and no worker is
        # grouped, so each caches under its own.
        self.namespaces = [worker_salt(worker_id, {}) for worker_id in worker_ids]
        self.subscriber: KVEventSubscriber | None = None
        self.caught_up = 0
        self.errors: list[str] = []
        self.connected = threading.Event()  # set once connected, or once that failed
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            sub = self.subscriber = KVEventSubscriber(
                self.endpoint, self.replay_endpoint, namespaces=self.namespaces)
            try:
                sub.wait_connected(HANDSHAKE_S)
                self.connected.set()
                while not self.stop.is_set():
                    sub.receive(100)
                self.caught_up = sub.catch_up()
            finally:
                sub.close()
        except Exception as exc:  # counted, never fatal: the soak reports it
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.connected.set()

    def report(self) -> dict[str, Any]:
        sub = self.subscriber
        counts = sub.counts if sub is not None else EventCounts()
        return {**dataclasses.asdict(counts), "caught_up": self.caught_up, "errors": self.errors,
                "cached_blocks": len(sub.cached) if sub is not None else None}


def scrape(rest: str) -> dict[str, float]:
    """The service's unlabelled samples, by name, from ``GET /metrics`` (no token needed)."""
    with urllib.request.urlopen(f"{rest}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def worker_ids(workers: int) -> list[str]:
    return [f"soak-{i}" for i in range(workers)]


def start_workers(addresses: list[str], duration_s: float, token: str,
                  prefix_caching: bool, overlap_workers: int) -> list[subprocess.Popen[str]]:
    """One loadgen per address; the last ``overlap_workers`` of them one step ahead."""
    prompts = ["--shared-prefix", str(SHARED_PREFIX)] if prefix_caching else []
    synchronous = len(addresses) - overlap_workers
    return [subprocess.Popen(
        [*kvalloc_command(), "loadgen", "--address", address, "--worker-id", worker_id,
         "--duration", str(duration_s), "--steps", str(10**9), "--step-interval", "0",
         "--seed", str(i), "--no-progress", "--json", *prompts,
         *(["--overlap"] if i >= synchronous else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVALLOC_TOKEN": token})
        for i, (address, worker_id) in enumerate(zip(addresses, worker_ids(len(addresses)),
                                                     strict=True))]


def run_load(svc: ServiceProcess, duration_s: float, workers: int, token: str,
             prefix_caching: bool, overlap_workers: int) -> tuple[list[dict[str, Any]], Churn]:
    """The workers' reports and the churn, once every worker exited and the churn stopped.
    ``workers`` counts the ``overlap_workers`` too."""
    addresses = [svc.ipc if i % 2 == 0 else svc.rest_tcp for i in range(workers)]
    procs = start_workers(addresses, duration_s, token, prefix_caching, overlap_workers)
    churn = Churn(svc.ipc, token)
    churn.start()
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=duration_s + 120)
        reports.append(json.loads(out) if out.strip() else {"errors": {"exit": err[-500:]}})
    churn.stop.set()
    churn.join()
    return reports, churn


def final_state(svc: ServiceProcess, token: str) -> tuple[PoolState, dict[str, float]]:
    """The pool (invariants checked) and the metrics of the quiet service. Its last change lies
    at least `METRICS_INTERVAL_S` back, so the registration here is copied for scrapes: the
    scrape after it is the current state, not a copy from before the workers left."""
    with Client(svc.ipc, worker_id="soak-check", token=token) as check:
        check.register(attach=False)
        pool = check.get_pool(verify=True)
        samples = scrape(svc.rest_tcp)
        check.deregister()
    return pool, samples


def soak(duration_s: float, workers: int, workdir: Path, warm_up_s: float,
         prefix_caching: bool = True, overlap_workers: int = 0) -> dict[str, Any]:
    """``workers`` synchronous loadgens and ``overlap_workers`` more one step ahead."""
    workers += overlap_workers
    # A token of its own: nothing is written outside ``workdir`` (a generated one would leave
    # its TCP endpoint's token file in the runtime directory), and the subscriber needs it.
    token = secrets.token_urlsafe(32)
    # The events are a Unix-socket stream (this user's alone): the subscriber needs no key.
    events = (f"ipc://{workdir / 'events.ipc'}", f"ipc://{workdir / 'replay.ipc'}")
    cache_args = ("--kv-events", events[0], "--kv-events-replay", events[1])
    with ServiceProcess(workdir, *POOL, *(cache_args if prefix_caching else ()),
                        env={"KVALLOC_TOKEN": token}) as svc:
        assert svc.proc is not None
        watch = (EventWatch(*events, [*worker_ids(workers), CHURN_ID])
                 if prefix_caching else None)
        if watch is not None:  # connected through both figures, so they count its sockets
            watch.start()
            watch.connected.wait()
        time.sleep(warm_up_s)
        start = process_usage(svc.proc.pid)
        reports, churn = run_load(svc, duration_s, workers, token, prefix_caching,
                                  overlap_workers)
        time.sleep(max(1.0, METRICS_INTERVAL_S))  # the workers' connections close
        end = process_usage(svc.proc.pid)
        if watch is not None:
            watch.stop.set()
            watch.join()
        pool, samples = final_state(svc, token)
    return {
        "duration_s": duration_s, "workers": workers, "prefix_caching": prefix_caching,
        "overlap_workers": overlap_workers,
        "steps": sum(r.get("steps", 0) for r in reports),
        "overlap_steps": sum(r.get("steps", 0) for r in reports if r.get("overlap")),
        "errors": {k: v for r in reports for k, v in r.get("errors", {}).items()},
        "churn": {"cycles": churn.cycles, "errors": churn.errors[:10]},
        "p99_ms": [r.get("latency_ms", {}).get("p99") for r in reports],
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in reports),
        "cached_tokens": sum(r.get("cached_tokens", 0) for r in reports),
        "left_in_pool": {"used_blocks": pool.used_blocks, "requests": pool.num_requests,
                         "cached_blocks": int(samples["kvalloc_prefix_cached_blocks"]),
                         "parked_blocks": pool.parked_blocks},
        # Blocks held with every request gone (parked cached blocks are not used ones).
        "leaked_blocks": pool.used_blocks,
        "events": watch.report() if watch is not None else None,
        "service": {"start": start, "end": end},
    }


def healthy(report: dict[str, Any]) -> bool:
    """The run ended as the module's docstring says a healthy one does (RSS and descriptors
    are figures to read, not judged here)."""
    events = report["events"]
    events_ok = events is None or (
        not events["errors"] and events["lost"] == 0 and events["anomalies"] == 0
        and events["cached_blocks"] == report["left_in_pool"]["cached_blocks"])
    return (not report["errors"] and not report["churn"]["errors"]
            and report["left_in_pool"]["requests"] == 0 and report["leaked_blocks"] == 0
            and events_ok)


def describe(report: dict[str, Any]) -> str:
    s, e = report["service"]["start"], report["service"]["end"]
    pool, events = report["left_in_pool"], report["events"]
    lines = [
        f"soak: {report['steps']} steps by {report['workers']} workers in "
        f"{report['duration_s']:.0f}s, {report['churn']['cycles']} register/deregister cycles",
        *([f"  one step ahead: {report['overlap_steps']} steps by "
           f"{report['overlap_workers']} of the workers"] if report["overlap_workers"] else []),
        f"  errors: {report['errors'] or 'none'}; churn errors: "
        f"{report['churn']['errors'] or 'none'}",
        f"  left in pool: {pool['requests']} requests, {pool['used_blocks']} blocks used, "
        f"{pool['parked_blocks']} of them parked in the cache; leaked {report['leaked_blocks']}",
        f"  service RSS {s['rss_kib'] // 1024} -> {e['rss_kib'] // 1024} MiB, open fds "
        f"{s['open_fds']} -> {e['open_fds']}"]
    if events is not None:
        lines += [
            f"  prefix cache: {report['cached_tokens']} of {report['prompt_tokens']} prompt "
            f"tokens cached",
            f"  KV events: {events['batches']} batches (joined at batch {events['joined_at']}), "
            f"{events['gaps']} gaps, {events['replayed']} replayed, {events['caught_up']} "
            f"caught up at the end, {events['refusals']} replay refusals, {events['lost']} "
            f"lost, {events['anomalies']} anomalies; {events['roots_checked']} stored roots "
            f"hash as their namespace's",
            *(f"    {text}" for text in [*events["described"], *events["errors"]]),
            f"  cached blocks: subscriber {events['cached_blocks']}, service "
            f"{pool['cached_blocks']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--workers", type=int, default=6, help="loadgen processes (default 6)")
    parser.add_argument("--overlap-workers", type=int, default=0,
                        help="loadgen processes one step ahead (--overlap), beside --workers "
                             "(default 0)")
    parser.add_argument("--warm-up", type=float, default=5.0,
                        help="seconds before the start figures: imports and first allocations "
                             "are not the steady state (default 5)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="no prefix cache and no KV events; prompts go without token ids")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvsoak-") as tmp:
        report = soak(args.duration, args.workers, Path(tmp), args.warm_up, args.prefix_caching,
                      args.overlap_workers)
    print(json.dumps(report) if args.json else describe(report))
    return 0 if healthy(report) else 1


if __name__ == "__main__":
    sys.exit(main())
