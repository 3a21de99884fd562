"""Two WAT shapes the GEMM kernels share: a function from its parts, and a counted loop whose
trip count is known at compile time."""

from __future__ import annotations


def wat_function(name: str, title: str, decls: list[str], code: list[str], params: str = "") -> str:
    return "\n".join([f"(func ${name}{params}", "  " + title, *("  " + d for d in decls), *("  " + c for c in code), ")"]) + "\n"


def counted_range(var: str, start: int, stop: int, step: int, body: list[str]) -> list[str]:
    """for var in range(start, stop, step), with the count known to be >= 1 at compile time."""
    if (stop - start + step - 1) // step == 1:
        return [f"(local.set {var} (i32.const {start}))", *body]
    label = var.replace("$", "$loop_")
    return [
        f"(local.set {var} (i32.const {start}))",
        f"(loop {label}",
        *("  " + s for s in body),
        f"  (local.set {var} (i32.add (local.get {var}) (i32.const {step})))",
        f"  (br_if {label} (i32.lt_u (local.get {var}) (i32.const {stop}))))",
    ]
