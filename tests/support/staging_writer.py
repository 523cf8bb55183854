"""A worker process that registers once told to, writes every byte of its staging buffer, and
holds its session until its stdin closes.

    python staging_writer.py ADDRESS WORKER_ID

It registers when a line arrives on its stdin (so a test can start many at once and let them
register one by one), then prints one line: ``written`` once the whole buffer is written, or
``refused <status> <code>: <message>`` when the service refused the registration (and exits 3).
A staging segment whose pages the service did not back dies here, writing it, with SIGBUS."""

from __future__ import annotations

import sys

from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError


def main(address: str, worker_id: str) -> int:
    client = Client(address, worker_id=worker_id)
    sys.stdin.readline()
    try:
        client.register()
    except RemoteError as exc:
        print(f"refused {exc.status} {exc.code}: {exc.message}", flush=True)
        return 3
    client.pool.staging.fill_(1)
    print("written", flush=True)
    sys.stdin.read()
    client.deregister()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
