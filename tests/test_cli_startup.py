"""What the `cortex` script imports before it does anything: every command pays it, so torch
(which `onnxruntime.tools` imports wherever it is installed, 3 s) is imported only by the models
that need onnxruntime's symbolic shape inference."""

from __future__ import annotations

import subprocess
import sys



def imported_modules(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                          capture_output=True, text=True, check=True, timeout=120)
    return set(done.stdout.split())


def test_the_cli_does_not_import_torch_or_onnxruntime_tools():
    modules = imported_modules("import cortex.cli")
    assert "cortex.commands.build" in modules
    assert not {"torch", "onnxruntime.tools", "sympy"} & modules


def test_a_contrib_model_still_gets_the_symbolic_shapes():
    modules = imported_modules("import onnx\nfrom passes.contrib_shapes import infer_contrib_shapes\n"
                               "m = onnx.helper.make_model(onnx.helper.make_graph([], 'g', [], []))\n"
                               "infer_contrib_shapes(m)")
    assert "onnxruntime.tools.symbolic_shape_infer" in modules
