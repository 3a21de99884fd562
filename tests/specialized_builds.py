"""Small models built for several input shapes, for the suites that run or check specializations.

The builds run the CLI's commands in this process (decompose, build-dag, compile-wasm through the
typer app): a fixture's build is set-up, not the behaviour under test, and three subprocesses per
build would cost most of a suite's time. The behaviour under test goes through the installed script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from cortex.cli import app
from ir.fs import write_bytes_atomically

WIDTH = 16
LAYERS = 4


def chain_model(path: Path, sub_at: int | None = None) -> Path:
    """LAYERS times MatMul -> Add(bias) -> Tanh over x[batch, WIDTH]; `sub_at` makes that layer's Add
    a Sub (a build of it has the same CUs, one of them computing something else)."""
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(LAYERS):
        w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.3
        b = rng.standard_normal(WIDTH).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Sub" if i == sub_at else "Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Tanh", [f"a{i}"], [f"t{i}"])]
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["batch", WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build_in_process(model: Path, out: Path, *decompose_options: str) -> Path:
    """decompose -> build-dag -> compile-wasm into `out`; returns its dag.json."""
    runner = CliRunner()
    for argv in (["decompose", "--model-path", model, "--output-dir", out / "cus", "--min-cu-size", "64",
                  "--max-cu-depth", "1", *decompose_options],
                 ["build-dag", "--cu-dir", out / "cus", "--output", out / "dag.json"],
                 ["compile-wasm", "--cu-dir", out / "cus", "--output", out / "wasm-bin", "--dag", out / "dag.json",
                  "--no-cache"]):
        result = runner.invoke(app, [str(a) for a in argv])
        assert result.exit_code == 0, (argv, result.output, result.exception)
    return out / "dag.json"


def plant(dag_path: Path, wrong_dag_path: Path, specialization: str, cu_id: str) -> None:
    """In `dag_path`'s bundle, make `cu_id` of `specialization` run the other build's module (its
    record, content-addressed module and weight files copied over); its cu.onnx stays the truth."""
    dag, wrong = json.loads(dag_path.read_text()), json.loads(wrong_dag_path.read_text())
    [wrong_section] = [s for s in wrong["specializations"] if s["name"] == specialization]
    record = next(cu for cu in wrong_section["cus"] if cu["id"] == cu_id)["artifacts"]["wasm"]
    for relative in [record["path"], *(w["path"] for w in record.get("weights", ()))]:
        write_bytes_atomically(dag_path.parent / relative, (wrong_dag_path.parent / relative).read_bytes())
    [section] = [s for s in dag["specializations"] if s["name"] == specialization]
    cu = next(cu for cu in section["cus"] if cu["id"] == cu_id)
    assert cu["artifacts"]["wasm"]["path"] != record["path"], "the planted module must differ"
    cu["artifacts"]["wasm"] = record
    write_bytes_atomically(dag_path, json.dumps(dag, indent=2).encode())


# -- a model whose If is decided by an input ---------------------------------------------------
VAD_FRAMES = {8000: 15, 16000: 7}     # output frames for a 512-sample window at each rate
CACHE = Path(__file__).resolve().parent.parent / ".cache" / "value-specializations"


def vad_model() -> Path:
    """A voice-activity model in small, exported by TorchScript (torch.jit.script, dynamo=False) as
    such models are: `if sr == 16000` picks a 128-tap filter at stride 64 over the 512-sample window
    (7 frames), else a 64-tap one at stride 32 (15 frames); a projection both share follows. The
    exporter writes Equal(sr, 16000) -> Cast(bool) -> If, branches of different output shapes."""
    path = CACHE / "vad.onnx"
    if path.is_file():
        return path
    import torch   # export only; importing it costs seconds, so only when the model is missing

    class TinyVad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.taps8k = torch.nn.Parameter(torch.randn(4, 1, 64, generator=generator) * 0.1)
            self.taps16k = torch.nn.Parameter(torch.randn(4, 1, 128, generator=generator) * 0.1)
            self.project = torch.nn.Parameter(torch.randn(4, 4, generator=generator) * 0.3)

        def forward(self, x: torch.Tensor, sr: torch.Tensor) -> torch.Tensor:
            if bool(sr == 16000):
                frames = torch.nn.functional.conv1d(x, self.taps16k, stride=64)
            else:
                frames = torch.nn.functional.conv1d(x, self.taps8k, stride=32)
            return torch.sigmoid(torch.matmul(frames.transpose(1, 2), self.project))

    CACHE.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    torch.onnx.export(torch.jit.script(TinyVad()), (torch.zeros(1, 1, 512), torch.tensor(16000)), str(partial),
                      input_names=["x", "sr"], output_names=["speech"], dynamo=False, opset_version=17)
    os.replace(partial, path)
    return path
