"""What a ``kvalloc`` command's ``--help`` loads: the dispatcher runs in a fresh interpreter, which
prints the help, then which of the named packages got imported on the way (one a prelude made
unimportable, a None in ``sys.modules``, was not)."""

from __future__ import annotations

import json
import subprocess
import sys

# argv[1]: the packages to look for, as JSON; the rest is the command line.
_SCRIPT = ("import json, sys\nfrom kvalloc.server.cli import main\nwatched = json.loads("
           "sys.argv.pop(1))\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
           "    assert exc.code == 0, exc.code\n"
           "print(json.dumps(sorted({m.split('.')[0] for m, module in sys.modules.items()\n"
           "                         if module is not None} & set(watched))))")


def help_and_imports(argv: list[str], packages: tuple[str, ...],
                     prelude: str = "") -> tuple[str, list[str]]:
    """The help ``kvalloc *argv`` prints, and those of ``packages`` it imported. ``prelude`` runs
    first (to make a package fail to import, say)."""
    r = subprocess.run([sys.executable, "-c", prelude + _SCRIPT, json.dumps(packages), *argv],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    *help_lines, imported = r.stdout.splitlines()
    return "\n".join(help_lines), json.loads(imported)
