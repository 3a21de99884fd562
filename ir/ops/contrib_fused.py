"""onnxruntime's fused ops that a model saved after its graph optimisations holds (a session's
`optimized_model_filepath` at ORT_ENABLE_EXTENDED; domain com.microsoft), each registered with a
function body that the expand-ops pass inlines: FusedConv (a Conv, an optional Z added to its
output, then an activation) and FusedGemm (a Gemm, then an activation). Expanded, the Conv or Gemm
and its activation fuse again in Cortex's own kernels.

The activations and their parameters are those of onnxruntime's MLAS activation
(`onnxruntime/core/mlas/inc/mlas.h`, `MLAS_ACTIVATION`): FusedConv passes them in
`activation_params`, FusedGemm in `activation_alpha`, `activation_beta` and `activation_gamma`.
"""

from __future__ import annotations

import numpy as np

from ir.errors import UnsupportedError
from ir.ops.function_body import Body
from ir.ops.registry import OTHER, register

DOMAIN = "com.microsoft"
CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
GEMM_ATTRIBUTES = ("alpha", "beta", "transA", "transB")


def _activate(body: Body, x: str, name: str, params: list[float], out: str) -> None:
    """`out` = activation `name` of `x`, with MLAS's parameters."""
    def param(i: int, default: float | None = None) -> float:
        if i < len(params):
            return float(params[i])
        if default is None:
            raise UnsupportedError(f"{body.node.describe()}: activation {name} needs {i + 1} parameters, "
                                   f"has {len(params)}")
        return default
    if name in ("Relu", "Tanh", "Sigmoid"):
        body.op(name, x, out=out)
    elif name == "LeakyRelu":
        body.op("LeakyRelu", x, out=out, alpha=param(0, 0.01))
    elif name == "HardSigmoid":
        body.op("HardSigmoid", x, out=out, alpha=param(0, 0.2), beta=param(1, 0.5))
    elif name == "Clip":
        low, high = (body.constant(np.float32(param(i))) for i in (0, 1))
        body.op("Clip", x, low, high, out=out)
    elif name == "Elu":
        body.op("Elu", x, out=out, alpha=param(0, 1.0))
    else:
        raise UnsupportedError(f"{body.node.describe()}: fused activation {name!r} is not supported")


def _fused_conv(node):
    body = Body(node, ("X", "W", "B", "Z"))
    attrs = {k: node.attrs[k] for k in CONV_ATTRIBUTES if k in node.attrs}
    y = body.op("Conv", "X", "W", body.input(2), **attrs)
    if body.present(3):
        y = body.op("Add", y, "Z")
    _activate(body, y, node.attrs.get("activation", "Relu"), list(node.attrs.get("activation_params", [])), "Y")
    return body.function(("Y",))


def _fused_gemm(node):
    body = Body(node, ("A", "B", "C"))
    attrs = {k: node.attrs[k] for k in GEMM_ATTRIBUTES if k in node.attrs}
    y = body.op("Gemm", "A", "B", body.input(2), **attrs)
    params = [node.attrs[k] for k in ("activation_alpha", "activation_beta", "activation_gamma") if k in node.attrs]
    _activate(body, y, node.attrs.get("activation", "Relu"), params, "Y")
    return body.function(("Y",))


register("FusedConv", domain=DOMAIN, kind=OTHER, expansion=_fused_conv)
register("FusedGemm", domain=DOMAIN, kind=OTHER, expansion=_fused_gemm)
