"""The `kvalloc` console script: one subcommand per module, each exposing
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status)."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("allocator.simulate", "overlap-scheduler model: finds IMA and row overflow"),
    "serve": ("server.serve", "run the allocator service (REST + IPC) until stopped"),
    "loadgen": ("server.loadgen", "simulated inference worker driving a running service"),
    "worker": ("worker.cli", "a transformers model decoding speculatively, KV in the pool"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvalloc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        # Only the chosen command's module is imported: `simulate` never pays for FastAPI.
        if argv and argv[0] == name:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args))


if __name__ == "__main__":
    raise SystemExit(main())
