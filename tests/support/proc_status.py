"""What /proc says about a process: its memory, to show a flood cost it none."""

from __future__ import annotations

from pathlib import Path


def memory_kib(pid: int, field: str) -> int:
    """A memory figure of /proc/<pid>/status in KiB: ``VmRSS`` now, ``VmHWM`` its peak."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)

