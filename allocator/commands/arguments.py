"""argparse types shared by the ``kvalloc`` commands. They live here, not in ``server``, because
``kvalloc simulate`` is part of the library, and the library never imports the service.

Each type's error becomes argparse's own: usage, the flag, the bad value and why, exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def argument_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type=``: its ValueError's message becomes argparse's error
    (argparse would otherwise replace it with a bare "invalid value")."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def bounded(kind: type[int] | type[float], low: float, high: float = float("inf"), *,
            low_open: bool = False) -> Callable[[str], int | float]:
    """A number of ``kind`` in [low, high] ((low, high] with ``low_open``)."""

    def parse(text: str) -> int | float:
        value = kind(text)
        # Written so that NaN, which compares false with everything, is outside too.
        if not low <= value <= high or (low_open and value == low):
            raise ValueError(f"{text} is not in {'(' if low_open else '['}{low:g}, {high:g}]")
        return value

    parse.__name__ = kind.__name__
    return argument_type(parse)


def _output_file(text: str) -> Path:
    path = Path(text)
    if not path.parent.is_dir():
        raise ValueError(f"{path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a directory")
    _check_writable(path)
    return path


def _check_writable(path: Path) -> None:
    """Open ``path`` for writing as the command will, so that a run never ends in a file it
    cannot write; a file that was not there is removed again. (Asking `os.access` is not
    enough: for root it says yes to a read-only mount or ``/proc``.)"""
    existed = path.exists()
    try:
        with path.open("a"):  # appends nothing: an existing file keeps its content
            pass
    except OSError as exc:
        raise ValueError(f"{path}: cannot write it ({exc.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)


output_file = argument_type(_output_file)
"""A file to write: its directory must exist and the file be writable, checked before the run."""
