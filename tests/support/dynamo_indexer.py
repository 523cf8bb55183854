"""Drives NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, from the PyPI
package ai-dynamo-runtime 1.6.1) from tests, so that kvalloc's KV events can be checked against
a real consumer of vLLM's event format rather than only against our own subscriber.

The indexer runs in its own interpreter (``KVALLOC_DYNAMO_PYTHON``, else
``<repo>/.venv/dynamo/bin/python``): its wheel is large and pins its own dependencies, so it stays
out of the project's venv. This module talks to it over HTTP with the standard library only.

What the indexer does, as measured against ai-dynamo-runtime 1.6.1 (see the findings that came
with this module):

- It subscribes (SUB, all topics) to each registered endpoint and hashes ``token_ids`` itself; a
  published ``block_hashes`` value only names a block for later ``BlockRemoved`` events and for
  children's ``parent_block_hash``. ``extra_keys`` is ignored; ``lora_name`` goes into the hash.
- ``query`` scores are matched prefix lengths in TOKENS (whole blocks only), per (instance,
  dp_rank); the dp_rank is the batch's ``data_parallel_rank`` when the batch carries one, the
  registered one otherwise.
- It expects sequence number 0 first; on a gap it asks the replay socket for the missing batches
  (only when a later batch arrives). Problems are logged as WARN lines on stderr.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv" / "dynamo" / "bin" / "python"
PYTHON_ENV = "KVALLOC_DYNAMO_PYTHON"

# Measured on a 2-core machine: 0.08-0.12 s from spawn to the first 200 from /health (6 runs,
# warm page cache), ~60 MiB RSS. 15 s leaves room for a cold cache and a loaded CI runner.
STARTUP_TIMEOUT_S = 15.0
# /register answers 201 before the publisher has seen the subscription: a batch sent at once
# was lost 17 times in 20 (tcp and ipc), one sent 5 ms later never (0 in 80). 20x that margin.
SUBSCRIBE_SETTLE_S = 0.1
# One HTTP call; a /dump of 16,000 blocks took 0.08 s.
HTTP_TIMEOUT_S = 10.0

# Substrings of the indexer's WARN/ERROR lines that mean its index no longer mirrors what was
# published (events dropped or not applied). "Gap detected" is left out: with a replay endpoint
# it is followed by "Replay complete" and nothing is lost.
FAILURE_PHRASES = (
    "Failed to find parent block",  # a BlockStored whose parent it does not hold: store skipped
    "Failed to find block to remove",  # a BlockRemoved hash it does not hold for that worker
    "No replay endpoint configured",  # a gap it could not fill
    "Replay incomplete",  # the replay socket did not return every missing batch
    "Failed to decode",  # a payload (live or replayed) it could not parse: batch dropped
    "token_ids too short",  # fewer token_ids than block_size * len(block_hashes)
    "Failed to send replay request",
    "Replay recv error",
    "ZMQ listener failed",
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"^\S+\s+(WARN|ERROR)\s")


class DynamoIndexerMissingError(RuntimeError):
    """No interpreter with ai-dynamo-runtime installed; tests may turn this into a skip."""


class DynamoIndexerError(RuntimeError):
    """The indexer refused a request or stopped; the message carries its reply or log tail."""


def find_python() -> Path:
    """The interpreter that has ``dynamo.indexer``: ``$KVALLOC_DYNAMO_PYTHON``, else the repo's
    ``.venv/dynamo``. Raises `DynamoIndexerMissingError` saying how to install it."""
    configured = os.environ.get(PYTHON_ENV)
    python = Path(configured) if configured else DEFAULT_PYTHON
    if not python.exists():
        raise DynamoIndexerMissingError(
            f"no Python with Dynamo's KV indexer at {python}: run `make routers` (installs "
            f"ai-dynamo-runtime==1.6.1 into {DEFAULT_PYTHON.parent.parent}) or set {PYTHON_ENV} "
            "to an interpreter where `python -m dynamo.indexer --help` works"
        )
    return python


def free_port() -> int:
    """A TCP port that was free a moment ago (the indexer has no port-0 option)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: Callable[[], Any], timeout_s: float = 5.0,
               interval_s: float = 0.02) -> Any:
    """The first truthy result of ``condition()``, polled until ``timeout_s``; then its last
    result. Events reach the index asynchronously (a batch took well under 0.1 s here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval_s)


class DynamoIndexer:
    """One ``dynamo.indexer`` process on a free port, for one model.

    Use as a context manager (or call `close`). Its stdout and stderr go to ``log_path``; the
    tracing lines are plain text (``DYN_SDK_DISABLE_ANSI_LOGGING=1``), INFO and up by default.
    """

    def __init__(self, log_path: Path | None = None, *, model_name: str = "default",
                 python: Path | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.python = python or find_python()
        self.model_name = model_name
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="dynamo-indexer-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = Path(log_path)
        # Requests go straight to 127.0.0.1 even when http_proxy is set in the environment.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # A port found free can be taken before the indexer binds it ("Address already in use"
        # and exit 1): try a few.
        for _attempt in range(3):
            self.port = free_port()
            if self._start(startup_timeout_s):
                return
        raise DynamoIndexerError(f"indexer did not start; log tail:\n{self._tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self, timeout_s: float) -> bool:
        """Spawn and wait for /health; False when it exited because the port was taken."""
        env = {**os.environ, "DYN_SDK_DISABLE_ANSI_LOGGING": "1"}
        earlier_lines = len(self.log())
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self._process = subprocess.Popen(
            [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._reap()
                if any("Address already in use" in line for line in self.log()[earlier_lines:]):
                    return False
                raise DynamoIndexerError(f"indexer exited; log tail:\n{self._tail()}")
            try:
                with self._http.open(self.url + "/health", timeout=1.0) as reply:
                    if reply.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        self.close()
        raise DynamoIndexerError(f"no /health within {timeout_s} s; log tail:\n{self._tail()}")

    def _request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or text); a 4xx/5xx is returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"content-type": "application/json"})
        try:
            with self._http.open(request, timeout=HTTP_TIMEOUT_S) as reply:
                status, text = reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return status, text  # deserialisation errors (422) come back as plain text

    def _call(self, path: str, body: dict[str, Any], expected: int = 200) -> Any:
        status, reply = self._request(path, body)
        if status != expected:
            raise DynamoIndexerError(f"POST {path} {json.dumps(body)} -> {status}: {reply}")
        return reply

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None,
                 block_size: int, dp_rank: int = 0,
                 settle_s: float = SUBSCRIBE_SETTLE_S) -> None:
        """Subscribe to ``endpoint`` (tcp:// or ipc://) as (instance_id, dp_rank), then wait
        ``settle_s`` for ZeroMQ's subscription to reach the publisher (see SUBSCRIBE_SETTLE_S).

        Bind the publisher first: against a not-yet-bound endpoint ZeroMQ retried only after
        about 1.5 s, and batches sent before that are recovered only once a later batch shows
        the gap and ``replay_endpoint`` is set. All workers of one model share one block_size
        (409 otherwise); registering the same (instance, dp_rank) twice is a 409 too.
        """
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": endpoint,
                                "model_name": self.model_name, "block_size": block_size,
                                "dp_rank": dp_rank}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._call("/register", body, expected=201)
        time.sleep(settle_s)

    def unregister(self, instance_id: int) -> None:
        """Drop the instance: every dp_rank of it, and its blocks (the indexer ignores a dp_rank
        here). 404 (raised) if it is not registered."""
        self._call("/unregister", {"instance_id": instance_id, "model_name": self.model_name})

    def query(self, token_ids: Iterable[int], *, lora_name: str | None = None,
              cache_salt: str | None = None) -> dict[tuple[int, int], int]:
        """Matched prefix length in tokens per (instance_id, dp_rank); absent means no match.

        ``lora_name`` must equal the events' ``lora_name`` to match. A ``cache_salt`` matched
        nothing we published: events have no field the indexer salts with (it ignores
        ``extra_keys``)."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        scores = self._call("/query", body)["scores"]
        return {(int(instance), int(rank)): int(tokens)
                for instance, ranks in scores.items() for rank, tokens in ranks.items()}

    def dump(self) -> dict[tuple[int, int], set[int]]:
        """Block hashes held per (instance_id, dp_rank).

        The dump is rebuilt from the indexer's radix tree, which keeps one hash per node: when
        several workers (or one worker twice) store the same tokens under different hashes, every
        holder is listed with the FIRST hash stored. Compare per worker only when workers hash
        the same content alike, as vLLM does."""
        status, reply = self._request("/dump")
        if status != 200:
            raise DynamoIndexerError(f"GET /dump -> {status}: {reply}")
        held: dict[tuple[int, int], set[int]] = {}
        for entry in reply.get(f"{self.model_name}:default", {}).get("events", []):
            event = entry["event"]
            blocks = held.setdefault((int(entry["worker_id"]), int(event["dp_rank"])), set())
            stored = event["data"].get("stored")
            if stored is None:
                raise DynamoIndexerError(f"unexpected event in /dump: {entry}")
            blocks.update(int(block["block_hash"]) for block in stored["blocks"])
        return held

    def log(self) -> list[str]:
        """Every line it has written so far (stdout and stderr), colour codes removed."""
        if not self.log_path.exists():
            return []
        text = self.log_path.read_text(errors="replace")
        return [_ANSI.sub("", line) for line in text.splitlines()]

    def warnings(self, phrases: Iterable[str] = FAILURE_PHRASES) -> list[str]:
        """WARN/ERROR lines that contain one of ``phrases`` (by default: events lost or not
        applied). Pass ``("",)`` for every WARN/ERROR line, e.g. to see "Gap detected"."""
        wanted = tuple(phrases)
        return [line for line in self.log()
                if _LEVEL.match(line) and any(phrase in line for phrase in wanted)]

    def _tail(self, lines: int = 30) -> str:
        return "\n".join(self.log()[-lines:])

    def _reap(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """SIGTERM (it exits within milliseconds), SIGKILL after 5 s; reap; close the log."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._reap()

    def __enter__(self) -> DynamoIndexer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
