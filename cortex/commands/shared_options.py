"""Options several commands share, spelled once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cortex.runtime import device_names
from ir.errors import CortexError

DeviceOption = Annotated[str, typer.Option("--device", help=f"One of: {', '.join(device_names())}.")]
ThreadsOption = Annotated[Optional[int], typer.Option("--threads", help="Ready CUs run at once on this many threads "
                                                     "(default: the machine's cores; 1: one after the other).")]


def checked_threads(threads: int | None) -> int | None:
    if threads is not None and threads < 1:
        raise CortexError(f"--threads must be at least 1, got {threads}")
    return threads
