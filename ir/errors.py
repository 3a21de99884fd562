"""User-facing errors.

A `CortexError` is a mistake in what the user gave us (a file, a flag, a model): the CLI prints its
message as one line on stderr and exits with code 2. Anything else escaping is a bug in Cortex.
"""


class CortexError(Exception):
    """A problem with the user's input, reported as one line and exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class ModelError(CortexError):
    """The model file or graph is unreadable or structurally broken."""


class UnsupportedError(CortexError):
    """The model uses something Cortex cannot handle yet (an op, a domain, a dtype)."""


class NeedsShapes(UnsupportedError):
    """An expansion that needs its inputs' ranks or shapes, which are not known yet: the node waits
    for shape inference (passes/expand_ops.py), and this is the error if they never become known."""


class NotExpanded(UnsupportedError):
    """An expansion that does not cover this node's form (string tensors, an attribute value it does
    not implement): the node stays as it is, so that a fallback CU may run it, and this is the
    reason given where it is left without a lowering (codegen/lower.py)."""
