"""The `cortex` command line. Each command lives in `cortex/commands/`; this file wires them up and
is the one funnel from exceptions to exit codes:

    0    success
    1    a check failed (`verify` outside its tolerance), out of memory, or a bug in Cortex (one line)
    2    a user mistake: a bad file, flag or model (one line naming it)
    130  interrupted (SIGINT); atomic writers have removed their temporary files

Commands are invoked through click's public API (`make_context` + `invoke`) rather than typer's
`standalone_mode=False`, which returns a `typer.Exit`'s code instead of raising it and turns
KeyboardInterrupt into `Exit(130)`: an exit code that the caller must not lose.
"""

from __future__ import annotations

import os
import signal
import sys

import typer

from ir.errors import CortexError

from backends.registry import targets
from cortex.commands import bench, build, build_dag, bundle, calibrate, decompose, generate, inspect_model, run, serve, verify
from cortex.commands.compile_target import compile_command

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Cortex: an ahead-of-time compiler from ONNX to computation units.")


@app.callback()
def _group() -> None:
    """Cortex: an ahead-of-time compiler from ONNX to computation units."""


# In pipeline order, as `cortex --help` lists them.
app.command("inspect")(inspect_model.inspect)
app.command("decompose")(decompose.decompose)
app.command("build-dag")(build_dag.build_dag)
for _target in targets().values():
    app.command(f"compile-{_target.name}")(compile_command(_target))
app.command("build")(build.build)
app.command("calibrate")(calibrate.calibrate)
app.command("run")(run.run)
app.command("verify")(verify.verify)
app.command("bench")(bench.bench)
app.command("serve")(serve.serve)
app.command("bundle")(bundle.bundle)
app.command("generate")(generate.generate)


def main(argv: list[str] | None = None) -> None:
    sys.exit(exit_code(sys.argv[1:] if argv is None else list(argv)))


def exit_code(argv: list[str]) -> int:
    """Run `cortex ARGV` and return its exit code; every failure has printed one line by then."""
    signal.signal(signal.SIGINT, signal.default_int_handler)   # KeyboardInterrupt: writers clean up
    command = typer.main.get_command(app)
    if not argv:
        with command.make_context("cortex", ["--help"], resilient_parsing=True) as ctx:
            print(ctx.get_help(), file=sys.stderr)
        return 2
    try:
        with command.make_context("cortex", argv) as ctx:
            command.invoke(ctx)
        return 0
    except typer.Exit as e:               # --help, or a command's own exit code (verify: 1)
        return e.exit_code
    except CortexError as e:
        return _fail(str(e), e.exit_code)
    except typer.TyperException as e:     # click's usage errors: bad option, missing argument (2)
        context = getattr(e, "ctx", None)
        where = context.command_path if context is not None else "cortex"
        return _fail(f"{e.format_message()} (see '{where} --help')", getattr(e, "exit_code", 2))
    except (KeyboardInterrupt, typer.Abort):
        return _fail("interrupted", 130)
    except MemoryError as e:
        return _fail(f"out of memory{f': {e}' if str(e) else ''}", 1)
    except BrokenPipeError:               # `cortex inspect ... | head`: the reader left
        return 1
    except Exception as e:  # a bug in Cortex, not a user mistake
        if os.environ.get("CORTEX_DEBUG"):
            raise
        return _fail(f"internal error: {type(e).__name__}: {e} (set CORTEX_DEBUG=1 for a traceback)", 1)


def _fail(message: str, code: int) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    main()
