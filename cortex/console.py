"""Where commands print: tables and progress to stdout, never to stderr (which carries errors)."""

import json
import sys

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
