"""docs/benchmarks.md is shared by several generators, each owning one section between its own
BEGIN/END markers; replacing one section leaves the others (and any text around them) untouched."""

from __future__ import annotations

from pathlib import Path

from ir.fs import write_bytes_atomically


def replace_section(path: Path, section: str, begin: str, end: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) in place of the page's section
    with those markers, or append it; the page is written atomically."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + section.rstrip("\n") + "\n" + (("\n" + after) if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    write_bytes_atomically(path, text.encode())
