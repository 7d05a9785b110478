"""The ``quarry`` console script and ``python -m quarry``.

Loading the command line (typer, pydantic, rich) takes a few tenths of a second, and
a Ctrl-C in that time printed a traceback of the import machinery. It is caught
here, where nothing but the standard library is loaded yet, and said as a Ctrl-C in
a command is: one line on stderr, with ``--json`` the error object on stdout, exit 130.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    """Load the command line and run it."""
    try:
        from quarry.cli import main as run
    except KeyboardInterrupt:
        arguments = sys.argv[1:]
        options = arguments[: arguments.index("--")] if "--" in arguments else arguments
        sys.stderr.write("quarry: error: interrupted\n")
        if any(a == "--json" or a.startswith("--json=") for a in options):
            error = {"type": "interrupted", "message": "interrupted", "exit_code": 130}
            sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()
        raise SystemExit(130) from None
    run()
