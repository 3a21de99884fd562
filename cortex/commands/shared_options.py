"""Options several commands share, spelled once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cortex.runtime import device_names

DeviceOption = Annotated[str, typer.Option("--device", help=f"One of: {', '.join(device_names())}.")]
MemoryBudgetOption = Annotated[Optional[float], typer.Option(
    "--memory-budget", help="Keep the resident CUs within this many MB: the least recently used is evicted, a "
    "prefetcher loads the next ones while one runs (default: every CU resident).")]
PinOption = Annotated[Optional[str], typer.Option(
    "--pin", help="CUs that stay resident under --memory-budget, comma-separated (cu-0003,cu-0007; default: the "
    "hot CUs 'cortex calibrate' recorded).")]
