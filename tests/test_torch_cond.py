"""A torch model with `torch.cond` on a data-dependent predicate, exported by the dynamo exporter
(`torch.onnx.export(dynamo=True)`, which writes the cond as an ONNX If whose branches are subgraphs
reading the outer graph's weights), compiles and runs both branches as onnxruntime does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cli_helpers import build_and_run
from samples.cache import CACHE_DIR, ensure_file


def cond_model() -> Path:
    def export(target: Path) -> None:
        import torch

        class Gate(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 8)

            def forward(self, x):
                def high(x):
                    return torch.tanh(self.linear(x)) * 2.0

                def low(x):
                    return torch.relu(x) - 1.0

                return torch.cond(x.sum() > 0, high, low, (x,))

        torch.manual_seed(0)
        program = torch.onnx.export(Gate().eval(), (torch.randn(2, 8),), dynamo=True, input_names=["x"],
                                    output_names=["y"], verbose=False)
        program.save(str(target))
    return ensure_file(CACHE_DIR / "models" / "torch-cond.onnx", export)


@pytest.mark.parametrize("sign", [1, -1], ids=["then-branch", "else-branch"])
def test_torch_cond_runs_the_branch_its_input_selects(sign, tmp_path):
    model = cond_model()
    assert "If" in [n.op_type for n in onnx.load(model).graph.node]     # the exporter's form of torch.cond
    x = sign * np.abs(np.random.default_rng(0).standard_normal((2, 8))).astype(np.float32)
    (want,) = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["y"], {"x": x})
    got = build_and_run(model, tmp_path, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Each branch's own signature: tanh * 2 stays inside (-2, 2); relu - 1 of a negative x is -1.
    if sign > 0:
        assert np.all(np.abs(got) < 2) and not np.allclose(got, -1.0)
    else:
        np.testing.assert_array_equal(got, np.full_like(got, -1.0))
