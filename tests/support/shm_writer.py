"""Another process of the service's user writing into one of its shared-memory segments, as any
such process can: it opens the file by path read-write, maps it and writes bytes at an offset.

    python shm_writer.py PATH OFFSET HEX

It imports nothing of kvalloc: it is not a worker, only a process with the same user."""

from __future__ import annotations

import mmap
import os
import sys


def main(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED) as memory:
            memory[offset:offset + len(data)] = data
    finally:
        os.close(fd)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]))
