"""Where commands print: tables and progress to stdout, never to stderr (which carries errors)."""

import json
import sys

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def print_summary(title: str, rows: list[tuple[str, str]]) -> None:
    """A command's closing summary: one label and one right-aligned value a row."""
    from rich.table import Table
    table = Table(title=title, show_header=False)
    table.add_column("")
    table.add_column("", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    out.print(table)
