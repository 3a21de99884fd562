"""Options several commands share, spelled once."""

from __future__ import annotations

from typing import Annotated

import typer

from cortex.runtime import device_names

DeviceOption = Annotated[str, typer.Option("--device", help=f"One of: {', '.join(device_names())}.")]
