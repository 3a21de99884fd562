"""The `cortex` console script: the SIGINT handler is installed before the CLI is imported.

Until a command runs, Ctrl-C has nothing to clean up, but importing the CLI (numpy, onnx, typer)
takes most of a second: without this handler a SIGINT then would print a traceback instead of one
line. `cortex.cli.exit_code` puts Python's KeyboardInterrupt back before any command runs, so that
atomic writers remove their temporary files.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_starting(signum, frame) -> None:
    os.write(2, b"error: interrupted\n")
    os._exit(130)


def main() -> None:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    from cortex.cli import exit_code   # deliberately after the handler (see above)
    sys.exit(exit_code(sys.argv[1:]))
