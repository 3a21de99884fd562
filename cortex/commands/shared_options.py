"""Options several commands share, spelled once. The runtime's own (`cortex run`, `bench`,
`serve`) are the fields of `RuntimeOptions` (cortex/runtime/options.py)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cortex.runtime import device_names

DeviceOption = Annotated[str, typer.Option("--device", help=f"One of: {', '.join(device_names())}.")]

ExecutorOption = Annotated[str, typer.Option("--executor", help="local (this process) or ray (the Ray cluster "
                                              "at --address).")]
AddressOption = Annotated[Optional[str], typer.Option("--address", help="The Ray cluster for --executor ray "
                                                      "(host:port of its head, or auto; default: the one in "
                                                      "RAY_ADDRESS, else a new local one).")]
