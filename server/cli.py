"""The `kvalloc` console script: one subcommand per module, each exposing
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status).

A bad flag is argparse's error: usage, the flag and the bad value, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata
from types import ModuleType

DESCRIPTION = ("KV-cache block allocator for LLM inference with speculative decoding: run the "
               "allocator service, drive it with a simulated worker, or reproduce the two "
               "capacity crashes in a simulation.")

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvalloc.allocator.tools.simulate",
                 "overlap-scheduler model: finds IMA and row overflow"),
    "serve": ("kvalloc.server.serve", "run the allocator service (REST + IPC) until stopped"),
    "loadgen": ("kvalloc.server.devtools.loadgen",
                "simulated inference worker driving a running service"),
    "worker": ("kvalloc.worker.cli", "a transformers model decoding speculatively, KV in the pool"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, unless the help already speaks of its default or
    there is nothing to show (no default, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # Identity, not equality: a default of 0 is shown, a flag's False is not.
        if "default" in text or any(action.default is v for v in (None, False,
                                                                   argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class _Version(argparse.Action):
    """``--version``. The release is read only when asked for: a source tree run without an
    install (``python -m server.cli``) has no package metadata, and must still start."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        try:
            release = metadata.version("kvalloc")
        except metadata.PackageNotFoundError:
            release = "(a source tree that is not installed)"
        print(f"kvalloc {release}")
        parser.exit()


# Commands whose flags live in a module of their own, so that --help loads none of the
# command's heavy imports.
PARSERS = {"serve": "kvalloc.server.serve_arguments", "worker": "kvalloc.worker.arguments"}
# Commands whose module needs an optional dependency: the extra that installs it.
EXTRAS = {"worker": "worker"}


def command_module(name: str) -> ModuleType:
    """The module of command ``name``. When one of its optional dependencies does not import:
    one line naming the pip extra that installs it, and exit status 2 (as a bad flag)."""
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as exc:
        if name not in EXTRAS or (exc.name or "").split(".")[0] == "kvalloc":
            raise
        print(f"kvalloc {name}: needs {exc.name!r}, which is not installed: "
              f"pip install 'kvalloc[{EXTRAS[name]}]'", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvalloc", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, help="print the installed release")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        # Only the chosen command's module is imported: `simulate` never pays for FastAPI.
        if argv and argv[0] == name:
            parsers = importlib.import_module(PARSERS[name]) if name in PARSERS else None
            (parsers or command_module(name)).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(command_module(args.command).run(args))
    except KeyboardInterrupt:
        # Ctrl-C where a command does not stop at a step boundary (loading, or a second Ctrl-C
        # while a step hangs): one line, not a traceback, and the shell's status for it.
        from kvalloc.allocator.commands.interrupt import INTERRUPTED

        print(f"kvalloc {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
