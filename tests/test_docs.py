"""Every fenced code block of README.md, CONTRIBUTING.md and docs/*.md runs, as a reader would
run it.

- ``python`` blocks run in a fresh interpreter, each on its own.
- ``sh`` blocks run line by line (comments stripped, one command per line). A trailing
  ``# exit N`` comment is the exit status the line must end with (default 0). ``kvalloc serve &``
  starts a real service in the background, waits until it answers, and is stopped (it must exit
  0) when the block ends.
- A block preceded by ``<!-- docs-test: serve -->`` runs while a real ``kvalloc serve`` with its
  defaults is up, as the examples that say "in another shell: kvalloc serve" expect.
- A block preceded by ``<!-- docs-test: skip, REASON -->`` is not run; it must give a reason.
  Any other language must be skipped that way.
- Every ``python -m pytest`` line of any block is collected (``--collect-only``) and must select
  at least one test: those blocks are skipped (they run the suite), and an example whose ``-k``
  matches nothing would show nothing.

Each block runs in a fresh directory with ``XDG_RUNTIME_DIR`` pointing into it (so the
service's default IPC socket is private to the test), the venv's ``bin`` first on ``PATH`` (as
an activated venv would be), no ``KVALLOC_TOKEN`` / ``KVALLOC_ADDRESS``, and the service's
documented port 8900 replaced by a free one in every command so that parallel runs never
collide, and ``DYNAMO_PYTHON`` naming the interpreter ``make routers`` installed Dynamo's
indexer in. Blocks run with a 4 GiB limit on their data segment, so an example whose pool a laptop
cannot hold fails here instead of taking the machine's memory.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvalloc.server.contract.addresses import DEFAULT_PORT
from kvalloc.server.devtools.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
MEMORY_LIMIT = 4 << 30  # bytes of data segment per block's process
RUNNABLE = {"python", "sh"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(\w+)(?:\s*,\s*(.*?))?\s*-->\s*\Z", re.S)


HEADING = re.compile(r"^#+\s+(.*)$", re.M)


@dataclass(frozen=True)
class Block:
    document: str
    section: str  # the heading it stands under, as a slug
    index: int  # its place among the section's blocks, from 1
    language: str
    code: str
    directive: str | None  # "skip", "serve" or None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.document}#{self.section}-{self.index}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found: list[Block] = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip()
        last = before[before.rfind("\n") + 1:]
        directive = DIRECTIVE.search(last)
        headings = HEADING.findall(FENCE.sub("", before))  # a "# comment" in a block is none
        section = re.sub(r"[^a-z0-9]+", "-", (headings or ["top"])[-1].lower()).strip("-")
        index = 1 + sum(b.section == section for b in found)
        found.append(Block(
            document=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name),
            section=section, index=index,
            language=match.group(1), code=match.group(2),
            directive=directive.group(1) if directive else None,
            reason=(directive.group(2) or "") if directive else ""))
    return found


ALL = [b for doc in DOCUMENTS for b in blocks(doc)]


def test_the_harness_finds_the_documents_blocks():
    """The parser is not silently finding nothing: the README's examples are there."""
    readme = [b for b in ALL if b.document == "README.md"]
    assert {b.language for b in readme} >= {"python", "sh"}
    assert len(ALL) >= 8


PYTEST_EXAMPLES = [(b, line) for b in ALL for line in b.code.splitlines()
                   if " -m pytest " in line and not line.lstrip().startswith("#")]


def test_the_documents_show_pytest_examples():
    assert len(PYTEST_EXAMPLES) >= 2


@pytest.mark.parametrize("block, line", PYTEST_EXAMPLES,
                         ids=[f"{b.name}:{i}" for i, (b, _) in enumerate(PYTEST_EXAMPLES)])
def test_a_documented_pytest_example_selects_tests(block: Block, line: str):
    """Skipped as blocks (they run the suite), so collected here: a selection that matches no
    test (pytest's exit 5) is an example that shows nothing."""
    args = shlex.split(line.split(" -m pytest ", 1)[1].split("#")[0])
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.name}: {line}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    # "N tests collected" (-q, and "N/M" with -k), or "path: N" per module (-qq)
    total = re.search(r"^(\d+)(?:/\d+)? tests? collected", r.stdout, re.M)
    counts = [int(total.group(1))] if total else [
        int(n) for n in re.findall(r"^\S+\.py: (\d+)$", r.stdout, re.M)]
    assert sum(counts) > 0, r.stdout[-2000:]


def test_directives_sections_and_exit_statuses_are_read_as_documented(tmp_path: Path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n\n## Run it\n\n<!-- docs-test: skip, needs a cluster -->\n```sh\n"
                   "kubectl apply\n```\n\n```python\n# not a heading\nx = 1\n```\n\n"
                   "<!-- docs-test: serve -->\n```python\npass\n```\n")
    skip, plain, served = blocks(doc)
    assert (skip.name, skip.directive, skip.reason) == ("doc.md#run-it-1", "skip",
                                                        "needs a cluster")
    assert (plain.name, plain.directive, plain.code) == ("doc.md#run-it-2", None,
                                                         "# not a heading\nx = 1\n")
    assert (served.name, served.directive) == ("doc.md#run-it-3", "serve")
    reader = Reader(tmp_path)
    reader.sh("exit 3   # exit 3: as the document says")
    with pytest.raises(AssertionError, match="exited 1, the document says 0"):
        reader.sh("false   # a comment that names no status")
    with pytest.raises(AssertionError, match="only `kvalloc serve &`"):
        reader.sh("sleep 1 &")


@pytest.mark.parametrize("block", [b for b in ALL if b.directive == "skip"], ids=lambda b: b.name)
def test_a_block_that_is_not_run_says_why(block: Block):
    assert block.reason, f"{block.name}: <!-- docs-test: skip, REASON --> needs its reason"


@pytest.mark.parametrize("block", [b for b in ALL if b.directive != "skip"], ids=lambda b: b.name)
def test_the_block_runs(block: Block, tmp_path: Path):
    assert block.directive in (None, "serve"), f"{block.name}: unknown {block.directive!r}"
    assert block.language in RUNNABLE, (
        f"{block.name}: a {block.language or 'plain'} block must be marked "
        f"<!-- docs-test: skip, REASON --> or be one of {sorted(RUNNABLE)}")
    reader = Reader(tmp_path)
    with reader.session():
        if block.directive == "serve":
            reader.serve([])
        if block.language == "python":
            reader.python(block.code)
        else:
            for line in block.code.splitlines():
                reader.sh(line)


class Reader:
    """Someone following the documents in a fresh directory, in an activated venv."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        runtime = workdir / "runtime"
        runtime.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVALLOC_TOKEN", "KVALLOC_ADDRESS")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["XDG_RUNTIME_DIR"] = str(runtime)
        # Where a reader who installed NVIDIA Dynamo's indexer in a venv of its own (as
        # ``make routers`` does) would point the router examples.
        env["DYNAMO_PYTHON"] = str(ROOT / ".venv" / "dynamo" / "bin" / "python")
        self.env = env
        self.services: list[tuple[subprocess.Popen[bytes], Path]] = []

    @contextmanager
    def session(self) -> Iterator[None]:
        try:
            yield
        finally:
            for proc, log in self.services:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                assert proc.returncode == 0, f"kvalloc serve exited {proc.returncode}:\n" + (
                    log.read_text())

    def _run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=self.workdir, env=self.env, capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_limit_memory)

    def python(self, code: str) -> None:
        script = self.workdir / "example.py"
        script.write_text(code)
        r = self._run([sys.executable, str(script)], timeout=300)
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"

    def sh(self, line: str) -> None:
        command, _, comment = line.partition(" #")
        command = command.strip().replace(f":{DEFAULT_PORT}", f":{self.port}")
        if not command or command.startswith("#"):
            return
        expected = re.search(r"\bexit (\d+)", comment)
        if command.endswith("&"):
            argv = shlex.split(command[:-1])
            assert argv[:2] == ["kvalloc", "serve"], f"only `kvalloc serve &` may go to the " \
                                                     f"background, not {command!r}"
            self.serve(argv[2:])
            return
        r = self._run(["bash", "-c", command], timeout=300)
        want = int(expected.group(1)) if expected else 0
        assert r.returncode == want, (
            f"{command!r} exited {r.returncode}, the document says {want}\n{r.stdout}\n"
            f"{r.stderr}")

    def serve(self, args: list[str]) -> None:
        """``kvalloc serve ARGS`` on this reader's port, once it answers /readyz."""
        log = self.workdir / f"serve-{len(self.services)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(["kvalloc", "serve", "--port", str(self.port), *args],
                                    cwd=self.workdir, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, preexec_fn=_limit_memory)
        self.services.append((proc, log))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"kvalloc serve exited {proc.returncode}:\n" + (
                log.read_text())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"kvalloc serve not ready after 60 s:\n{log.read_text()}")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_LIMIT, MEMORY_LIMIT))
