"""onnxruntime's transformer-optimizer ops (domain com.microsoft), each registered with an ONNX
function body over standard ops that the expand-ops pass inlines (see passes/expand_ops.py).

The bodies follow onnxruntime's kernels (onnxruntime/contrib_ops/cpu/bert/), not only the
operator docs, so that a model matches onnxruntime where the docs are silent (defaults, the
optional inputs' forms).
"""

from __future__ import annotations

import onnx.parser

from ir.ops.registry import ELEMENTWISE, register

DOMAIN = "com.microsoft"
OPSET = 17      # the standard ops the bodies use (LayerNormalization needs 17)


def function(text: str) -> onnx.FunctionProto:
    """A body in ONNX's textual syntax; the header's domain and opset are filled in here."""
    return onnx.parser.parse_function(f'<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>\n{text}')


def _gelu(node) -> onnx.FunctionProto:
    return function("""
        Gelu (X) => (Y) {
            half = Constant <value = float {0.5}> ()
            one = Constant <value = float {1.0}> ()
            rsqrt2 = Constant <value = float {0.70710678118654752}> ()
            scaled = Mul (X, rsqrt2)
            e = Erf (scaled)
            shifted = Add (e, one)
            halfx = Mul (X, half)
            Y = Mul (halfx, shifted)
        }""")


register("Gelu", domain=DOMAIN, kind=ELEMENTWISE, expansion=_gelu)
