"""The ONNX backend node tests, regenerated into `.cache/onnx-node-tests/<case>/`.

The onnx wheel no longer ships `onnx/backend/test/data/node/`; the cases are still defined in
Python (`onnx.backend.test.case.node`), and `onnx.backend.test.cmd_tools.generate_data` writes them
in the usual layout (`model.onnx` + `test_data_set_0/{input,output}_N.pb`) once its model-case
collector is pointed at the node cases. Random case data is seeded so regeneration is repeatable.
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
from onnx import numpy_helper

from samples.cache import CACHE_DIR, ensure_folder

NODE_TESTS_DIR = CACHE_DIR / "onnx-node-tests"


def ensure_node_tests(force: bool = False) -> Path:
    return ensure_folder(NODE_TESTS_DIR, _generate, force)


def _generate(folder: Path) -> None:
    import onnx.backend.test.case.node as node_cases
    from onnx.backend.test import cmd_tools

    np.random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow on purpose (Cast, Reduce*)
        cases = node_cases.collect_testcases(None)
        with mock.patch.object(cmd_tools.model_test, "collect_testcases", lambda: cases):
            cmd_tools.generate_data(argparse.Namespace(output=str(folder)))
    # generate_data writes <output>/<kind>/<case>; every node case has kind "node".
    for case_dir in (folder / "node").iterdir():
        case_dir.rename(folder / case_dir.name)
    shutil.rmtree(folder / "node")


@dataclass
class NodeTestCase:
    name: str
    path: Path                     # model.onnx
    inputs: dict[str, object]      # name -> ndarray, or list / None / dict for non-tensor inputs
    outputs: dict[str, object]     # name -> the reference output, same conventions


def node_test_names() -> list[str]:
    folder = ensure_node_tests()
    return sorted(p.name for p in folder.iterdir() if (p / "model.onnx").is_file())


def load_node_test(name: str) -> NodeTestCase:
    case_dir = ensure_node_tests() / name
    path = case_dir / "model.onnx"
    model = onnx.load(path, load_external_data=False)
    data_dir = case_dir / "test_data_set_0"
    inputs = {vi.name: load_value(data_dir / f"input_{i}.pb", vi.type)
              for i, vi in enumerate(model.graph.input) if (data_dir / f"input_{i}.pb").exists()}
    outputs = {vi.name: load_value(data_dir / f"output_{i}.pb", vi.type)
               for i, vi in enumerate(model.graph.output)}
    return NodeTestCase(name, path, inputs, outputs)


def load_value(path: Path, type_proto: onnx.TypeProto):
    """Read one .pb of a test data set as the Python value onnxruntime takes or returns."""
    data = path.read_bytes()
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        proto = onnx.SequenceProto()
        proto.ParseFromString(data)
        return numpy_helper.to_list(proto)
    if kind == "optional_type":
        proto = onnx.OptionalProto()
        proto.ParseFromString(data)
        return numpy_helper.to_optional(proto)
    if kind == "map_type":
        proto = onnx.MapProto()
        proto.ParseFromString(data)
        return numpy_helper.to_dict(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(data)
    return numpy_helper.to_array(proto)
