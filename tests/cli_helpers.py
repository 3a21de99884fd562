"""Running the `cortex` CLI in-process from tests, and what a user-mistake error must look like."""

from __future__ import annotations

import pytest

from cortex.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cortex ARGV`."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
        raise SystemExit(0)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    """Exit code 2, one `error: ...` line on stderr holding every fragment, no traceback."""
    assert code == 2, f"exit code {code}, stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
