"""The `cortex` command line. Each command lives in `cortex/commands/`; this file wires them up and
turns user mistakes into one line on stderr with exit code 2."""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions

from ir.errors import CortexError

from cortex.commands import (bench, build_dag, compile_cuda, compile_wasm, decompose, inspect_model, run,
                             verify)

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Cortex: an ahead-of-time compiler from ONNX to computation units.")


@app.callback()
def _group() -> None:
    """Cortex: an ahead-of-time compiler from ONNX to computation units."""


# In pipeline order, as `cortex --help` lists them.
app.command("inspect")(inspect_model.inspect)
app.command("decompose")(decompose.decompose)
app.command("build-dag")(build_dag.build_dag)
app.command("compile-wasm")(compile_wasm.compile_wasm)
app.command("compile-cuda")(compile_cuda.compile_cuda)
app.command("run")(run.run)
app.command("verify")(verify.verify)
app.command("bench")(bench.bench)


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, prog_name="cortex", standalone_mode=False)
    except CortexError as e:
        _fail(str(e), e.exit_code)
    except click_exceptions.NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx else "", file=sys.stderr)
        sys.exit(2)
    except click_exceptions.UsageError as e:
        command = e.ctx.command_path if e.ctx else "cortex"
        _fail(f"{e.format_message()} (see '{command} --help')", 2)
    except click_exceptions.Abort:
        _fail("aborted", 130)
    except click_exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except MemoryError:
        _fail("out of memory", 1)
    except Exception as e:  # a bug in Cortex, not a user mistake
        if os.environ.get("CORTEX_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (set CORTEX_DEBUG=1 for a traceback)", 1)


def _fail(message: str, code: int) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
